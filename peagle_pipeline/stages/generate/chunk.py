"""One chunk of `generate`: its conversations generated wave by wave, then laid out as rows and rejects.

Wave j asks the backend for reply j of every conversation (and sample) still going, in one call; the conversations
grow by token ids (`data/dialogue.py`). Every request's seed is a function of (seed, row, sample, turn), so a
chunk's calls, and its output, are a function of its rows: a resumed run regenerates a chunk exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from peagle_pipeline.backends.generation import GenerationBackend, SamplingSettings, request_seed
from peagle_pipeline.config import GenerateConfig
from peagle_pipeline.data.dialogue import REASON_TOO_LONG, Dialogue, DialogueBuilder
from peagle_pipeline.data.onpolicy_files import ChunkOutput

__all__ = ["generate_chunk"]


def generate_chunk(
    rows: list[tuple[int, Any]],
    builder: DialogueBuilder,
    backend: GenerationBackend,
    sampling: SamplingSettings,
    cfg: GenerateConfig,
    on_wave: Callable[[int, int], None] | None = None,
) -> ChunkOutput:
    """Generate every conversation of one chunk, wave by wave, and lay out its rows and rejects in row order.

    Args:
        rows: (global row index, Conversation or Reject) of this chunk.
        on_wave: called after each wave with (replies, generated tokens) of that wave.
    """
    out = ChunkOutput()
    plan = _start_dialogues(rows, builder, cfg)
    _run_waves([d for _, _, ds in plan for d in ds], builder, backend, sampling, cfg, out, on_wave)
    _lay_out(plan, out)
    return out


_Planned = tuple[Any, str | None, list[Dialogue]]
"""A row of a chunk: the row, why it is rejected (None: it goes on) and its dialogues (one per sample)."""


def _start_dialogues(
    rows: list[tuple[int, Any]], builder: DialogueBuilder, cfg: GenerateConfig
) -> list[_Planned]:
    """Each row's first prompt rendered and forked into `samples_per_prompt` dialogues, or the reason it is not."""
    from peagle_pipeline.data.chat import RejectRow
    from peagle_pipeline.data.records import Reject

    plan: list[_Planned] = []
    for index, row in rows:
        if isinstance(row, Reject) and row.prompt is not None:
            row = row.prompt  # a prompt without a reply: the target writes it
        if isinstance(row, Reject):
            plan.append((row, row.reason, []))
            continue
        try:
            first = builder.start(row, index)
        except RejectRow as err:
            plan.append((row, err.reason, []))
            continue
        if len(first.input_ids) > cfg.max_prompt_tokens:
            plan.append((row, REASON_TOO_LONG, []))
            continue
        plan.append((row, None, [first] + [builder.fork(first, s) for s in range(1, cfg.samples_per_prompt)]))
    return plan


def _run_waves(
    dialogues: list[Dialogue],
    builder: DialogueBuilder,
    backend: GenerationBackend,
    sampling: SamplingSettings,
    cfg: GenerateConfig,
    out: ChunkOutput,
    on_wave: Callable[[int, int], None] | None,
) -> None:
    """Wave j: reply j of every dialogue still going, in one backend call, until none is (counts into `out`)."""
    while True:
        for d in dialogues:
            if d.active and len(d.input_ids) > cfg.max_prompt_tokens:
                d.ended = REASON_TOO_LONG
        active = [d for d in dialogues if d.active]
        if not active:
            break
        seeds = [request_seed(cfg.seed, d.index, d.sample, d.turn) for d in active]
        replies = backend.generate([d.input_ids for d in active], seeds, sampling)
        for d, reply in zip(active, replies, strict=True):
            out.generated_tokens += len(reply.token_ids)
            out.finish_length += reply.finish == "length"
            builder.add_reply(d, reply.token_ids, reply.finish)
        if on_wave is not None:
            on_wave(len(active), sum(len(r.token_ids) for r in replies))


def _lay_out(plan: list[_Planned], out: ChunkOutput) -> None:
    """The chunk's kept rows and its rejects (a row's, a sample's without a reply, dropped turns), in row order."""
    for row, reason, ds in plan:
        where = {"source": row.source, "source_row": row.source_row}
        if reason is not None:
            out.rejects.append({**where, "reason": reason})
        for d in ds:
            if d.turn == 0:
                out.rejects.append({**where, "reason": d.ended or "no reply", "sample": d.sample})
                continue
            kept = d.to_row()
            out.rows.append(kept)
            out.replies += d.turn
            out.supervised_tokens += sum(kept["loss_mask"])
            if d.ended is not None and d.dropped_turns:
                out.rejects.append(
                    {**where, "reason": f"later turns dropped: {d.ended}", "sample": d.sample, "turn": d.turn}
                )
