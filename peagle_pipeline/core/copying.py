"""Which next tokens the context already spells out: the bigram copy rule.

A target that repeats itself (lists, code, a greedy small model's loops) emits many tokens that a plain lookup of
the context predicts: after the last two tokens (a, b), the token that followed the latest earlier (a, b). A draft
that serves such a target should get those positions right. `bigram_copy_prediction` gives the rule's guess at
every position, so a draft's agreement can be split into positions the rule gets right, gets wrong, and has no
guess for (the trainer's held-out figures, `experiments/draft_on_cache.py`, docs/results/what-we-learned.md).
Pure torch, no I/O.
"""

from __future__ import annotations

import torch

__all__ = ["NO_GUESS", "COPY_RIGHT", "COPY_WRONG", "COPY_NONE", "bigram_copy_prediction", "copy_classes"]

NO_GUESS = -1
"""The rule's value at a position whose last two tokens never occurred together before."""
COPY_RIGHT, COPY_WRONG, COPY_NONE = 0, 1, 2
"""`copy_classes` values: the rule guesses the next token right, guesses wrong, has no guess (or no next token)."""


def bigram_copy_prediction(tokens: torch.Tensor) -> torch.Tensor:
    """The bigram copy rule's guess of each next token.

    Args:
        tokens: LongTensor[L], one sequence.

    Returns:
        LongTensor[L]: at position i, the token that followed the latest earlier occurrence of the pair
        (tokens[i-1], tokens[i]), i.e. the rule's guess of tokens[i+1] from tokens[:i+1] alone; NO_GUESS where
        that pair has no earlier occurrence (and at position 0).
    """
    seq = tokens.tolist()
    out = [NO_GUESS] * len(seq)
    follower: dict[tuple[int, int], int] = {}  # (a, b) -> the token after its latest occurrence so far
    for i in range(1, len(seq)):
        if i >= 2:  # the pair (seq[i-2], seq[i-1]) was followed by seq[i]: known once seq[i] is
            follower[(seq[i - 2], seq[i - 1])] = seq[i]
        out[i] = follower.get((seq[i - 1], seq[i]), NO_GUESS)
    return torch.tensor(out, dtype=torch.long)


def copy_classes(tokens: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """The rule's verdict on the next token at every position of packed sequences.

    Args:
        tokens: LongTensor[L], sequences laid end to end (a packed row of shifted tokens).
        lengths: the sequences' lengths, summing to L; the rule never looks across them.

    Returns:
        LongTensor[L]: COPY_RIGHT where the rule's guess equals the sequence's next token, COPY_WRONG where it
        guesses another, COPY_NONE where it has no guess or the sequence has no next token.
    """
    out = []
    for seq in tokens.cpu().split(lengths):
        guess = bigram_copy_prediction(seq)
        following = torch.cat([seq[1:], seq.new_full((1,), NO_GUESS)])
        verdict = torch.where(guess == following, COPY_RIGHT, COPY_WRONG)
        out.append(torch.where((guess == NO_GUESS) | (following == NO_GUESS), COPY_NONE, verdict))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)
