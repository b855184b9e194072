"""The bigram copy rule: its guess comes from earlier context only, and from the latest earlier occurrence."""

from __future__ import annotations

import torch

from peagle_pipeline.core.copying import NO_GUESS, bigram_copy_prediction


def _brute_force(seq: list[int]) -> list[int]:
    """The rule spelled out: scan back from position i for the latest j < i with (seq[j-1], seq[j]) equal to
    (seq[i-1], seq[i]); guess seq[j+1]."""
    out = []
    for i in range(len(seq)):
        guess = NO_GUESS
        for j in range(i - 1, 0, -1):
            if (seq[j - 1], seq[j]) == (seq[i - 1], seq[i]) and i >= 1:
                guess = seq[j + 1]
                break
        out.append(guess)
    return out


def test_a_loop_is_predicted_from_its_second_pass_on():
    seq = [7, 1, 2, 3, 1, 2, 3, 1, 2]
    got = bigram_copy_prediction(torch.tensor(seq)).tolist()
    # positions 0..4 have no earlier (a, b); at 5 the pair (1, 2) was followed by 3, and so on
    assert got == [NO_GUESS] * 5 + [3, 1, 2, 3]
    # every guess the rule makes in a loop is the true next token
    assert all(g == seq[i + 1] for i, g in enumerate(got[:-1]) if g != NO_GUESS)


def test_the_latest_occurrence_wins_and_nothing_is_read_ahead():
    seq = [4, 5, 6, 4, 5, 9, 4, 5, 8]
    got = bigram_copy_prediction(torch.tensor(seq)).tolist()
    assert got[4] == 6  # (4, 5) was followed by 6
    assert got[7] == 9  # ... and later by 9: the latest counts
    assert got[1] == NO_GUESS  # the pair (4, 5) at positions 0, 1 is its own first occurrence


def test_matches_the_rule_spelled_out_on_random_sequences():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        seq = torch.randint(0, 4, (60,), generator=g)
        assert bigram_copy_prediction(seq).tolist() == _brute_force(seq.tolist())
    assert bigram_copy_prediction(torch.tensor([], dtype=torch.long)).tolist() == []
    assert bigram_copy_prediction(torch.tensor([3])).tolist() == [NO_GUESS]


def test_copy_classes_judge_each_packed_sequence_alone():
    from peagle_pipeline.core.copying import COPY_NONE, COPY_RIGHT, COPY_WRONG, copy_classes

    loop = [1, 2, 3, 1, 2, 3, 1, 2]  # from position 4 on, the rule guesses right; the last has no next token
    swerve = [1, 2, 9, 1, 2, 8]  # at position 4 the rule guesses 9, the next token is 8
    got = copy_classes(torch.tensor(loop + swerve), [len(loop), len(swerve)]).tolist()
    assert got[: len(loop)] == [COPY_NONE] * 4 + [COPY_RIGHT] * 3 + [COPY_NONE]
    # the second sequence starts afresh: (1, 2) of the first one does not count
    assert got[len(loop) :] == [COPY_NONE] * 4 + [COPY_WRONG, COPY_NONE]
    assert copy_classes(torch.zeros(0, dtype=torch.long), []).tolist() == []
