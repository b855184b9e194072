"""What vLLM drafts against what our draft model computes, token by token.

Every speculative step, vLLM's proposer drafts K tokens from the last verified position (the anchor): at once for a
P-EAGLE export, in K sequential steps for an EAGLE-3 one (our forward then feeds each step its previous argmax).
`compare_proposals` records those proposals (a wrapper around vLLM's own `SpecDecodeBaseProposer.propose` in an
in-process engine, one request at a time, T = 0), walks each greedy output as vLLM did (after n accepted tokens
the next anchor is n + 1 further on) and looks up, for every drafted token, the argmax of
`PEagleDraft.forward_layout` (or `Eagle3Draft.forward_layout(greedy=True)`) over full chains of the same tokens, with the target's aux states from our HF
extraction code, mapped through the draft vocabulary. Used by `test_drafts_match_vllm.py`; also a script for any
export (run in the vLLM environment, not collected by pytest):

    .venv-vllm/bin/python tests/vllm/proposals.py --target .demo/models/SmolLM2-135M-Instruct --export RUN/export \
        [--prompts mt-bench --num-prompts 80] [--max-tokens 64]

It prints one JSON object: drafted and compared tokens, mismatches (first 10), equal and distinct tokens per depth,
and the acceptance the walk implies beside vLLM's own counters.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "PROMPTS",
    "Comparison",
    "recorded_proposals",
    "chat_prompts",
    "our_proposals",
    "core_walk",
    "compare_proposals",
]

PROMPTS = ("What is the capital of France?", "Write a short poem about the sea.", "Explain quicksort.")


@dataclass
class Comparison:
    """vLLM's proposals against our draft model's, over every prompt."""

    drafted: int = 0
    """Tokens vLLM drafted."""
    compared: int = 0
    """Of those, tokens whose chain lies inside the output (ours is defined there)."""
    equal_per_depth: list[int] = field(default_factory=list)
    compared_per_depth: list[int] = field(default_factory=list)
    distinct_per_depth: list[int] = field(default_factory=list)
    """Different tokens vLLM drafted at each depth (a check that tells drafts apart needs several)."""
    mismatches: list[dict[str, int]] = field(default_factory=list)
    """The first 10: anchor, depth, vLLM's token, ours."""
    steps: int = 0
    """Steps the walk says vLLM verified."""
    truncated_steps: int = 0
    """Of those, steps whose accepted tokens reached `max_tokens`: vLLM may have accepted more than the output
    shows (it cuts the reply there), so at each position its counter may exceed the walk's by one per such step."""
    accepted_per_position: list[int] = field(default_factory=list)
    """Accepted tokens per position, by the walk."""
    core_walk_accepted: int = 0
    core_walk_steps: int = 0
    """`core.loss.acceptance_walk` over the same replies with our proposals (what the trainer reports)."""
    vllm_drafts: int = 0
    """vLLM's own counters over the same requests."""
    vllm_accepted_per_position: list[int] = field(default_factory=list)


@contextlib.contextmanager
def recorded_proposals() -> Iterator[list[list[int]]]:
    """Every K-token proposal vLLM's drafter returns while the context is open (one request in flight: one row
    per step), in order."""
    from vllm.v1.spec_decode import llm_base_proposer

    calls: list[list[int]] = []
    cls = llm_base_proposer.SpecDecodeBaseProposer
    propose = cls.propose

    def recording(self: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = propose(self, *args, **kwargs)
        if out.shape[0] != 1:
            raise RuntimeError(f"{out.shape[0]} requests in one step: the walk needs one at a time")
        calls.append(out[0].tolist())
        return out

    cls.propose = recording  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        cls.propose = propose  # type: ignore[method-assign]


@contextlib.contextmanager
def environment_restored() -> Iterator[None]:
    """os.environ as it was on entry, on exit: an in-process engine sets vLLM variables (VLLM_ENABLE_V1_MULTIPROCESSING
    = 0 among them) that would change how later engines and CLI subprocesses of a test session run."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def chat_prompts(target: str | Path, texts: tuple[str, ...] = PROMPTS) -> list[list[int]]:
    """Each text as one user turn in the target's chat template, ending with the generation prompt (token ids)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    chats = [
        tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
        for t in texts
    ]
    return [tok(chat, add_special_tokens=False)["input_ids"] for chat in chats]


def _vllm_run(target: Path, export: Path, prompts: list[list[int]], depths: int, max_tokens: int) -> Any:
    """Per prompt (output token ids, vLLM's proposals), and vLLM's spec-decode counters before and after."""
    from vllm import SamplingParams

    from peagle_pipeline.backends.vllm import EngineSettings
    from peagle_pipeline.model_dir import read_target_info, text_config
    from peagle_pipeline.stages.evaluate.acceptance import engine, read_counters, speculative_config

    runs = []
    with environment_restored(), recorded_proposals() as calls:
        # the target's whole context, vLLM's default but for LongRoPE targets (their original context)
        context = text_config(read_target_info(target).config)["max_position_embeddings"]
        settings = EngineSettings(model=str(target), dtype="fp32", max_model_len=context)
        with engine(settings, speculative_config(export, depths)) as (llm, _):
            before = read_counters(llm)
            for ids in prompts:
                first = len(calls)
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
                out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
                runs.append((list(out.outputs[0].token_ids), calls[first:]))
            after = read_counters(llm)
    return runs, before, after


def our_proposals(target: Path, export: Path, tokens: list[int], depths: int) -> dict[tuple[int, int], int]:
    """(anchor, depth) -> the token our draft drafts there, for every full chain of one sequence (fp32)."""
    from peagle_pipeline.backends.hf import HFBackend
    from peagle_pipeline.config import ExtractConfig
    from peagle_pipeline.core import cod
    from peagle_pipeline.core.eagle3 import Eagle3Draft
    from peagle_pipeline.core.mask import dense_mask
    from peagle_pipeline.stages.export.speculators_format import load_export
    from peagle_pipeline.stages.extract.settings import backend_settings

    draft = load_export(export, dtype=torch.float32).eval()
    layer_ids = json.loads((export / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
    cfg = ExtractConfig(model=str(target), data=["unused"], output="unused", device="cpu", dtype="fp32")
    hf = HFBackend(backend_settings(cfg), layer_ids)
    try:
        aux = hf.forward([tokens])[0].aux_hidden.float()
    finally:
        hf.close()
    n = len(tokens) - 1  # shifted rows: row i pairs token x_{i+1} with the aux states of x_i
    valid = torch.ones(n, dtype=torch.bool)
    layout = cod.build_layout([n], valid, cod.CODConfig(depths=depths), None, full=True)
    x = torch.tensor(tokens)
    with torch.no_grad():
        if isinstance(
            draft, Eagle3Draft
        ):  # K steps, each fed the previous step's argmax as vLLM feeds its draft
            hidden = draft.forward_layout(layout, x[1 : n + 1], aux[:n].reshape(n, -1), greedy=True)
        else:
            hidden = draft.forward_layout(layout, x[1 : n + 1], aux[:n].reshape(n, -1), dense_mask(layout))
        best = draft.logits(hidden).argmax(-1)
    if getattr(draft, "d2t", None) is not None:  # none when the draft keeps the whole vocabulary
        best = best + draft.d2t[best]
    return {(int(a), int(d)): int(t) for a, d, t in zip(layout.anchor, layout.depth, best, strict=True)}


def core_walk(
    tokens: list[int], prompt_len: int, ours: dict[tuple[int, int], int], depths: int
) -> tuple[int, int]:
    """(accepted, steps) of `core.loss.acceptance_walk` (the trainer's `acceptance_walk`) over one reply, from our
    proposals: the reply's rows weighted, an element correct when it drafts the reply's token."""
    from peagle_pipeline.core import cod, loss

    n = len(tokens) - 1
    weight = torch.arange(n) >= prompt_len - 1  # row i is weighted when x_{i+1} is a reply token
    layout = cod.build_layout([n], weight, cod.CODConfig(depths=depths), None, full=True)
    correct = torch.tensor(
        [
            int(a) + int(d) + 2 < len(tokens) and ours[(int(a), int(d))] == tokens[int(a) + int(d) + 2]
            for a, d in zip(layout.anchor, layout.depth, strict=True)
        ],
        dtype=torch.bool,
    )
    return loss.acceptance_walk(layout, correct, layout.element_weight(weight), depths)


def compare_proposals(
    target: str | Path, export: str | Path, prompts: list[list[int]], depths: int, max_tokens: int = 40
) -> Comparison:
    """vLLM's proposals for `prompts` (greedy, `max_tokens` new tokens, K = `depths`) against ours."""
    target, export = Path(target), Path(export)
    runs, before, after = _vllm_run(target, export, prompts, depths, max_tokens)
    c = Comparison(
        equal_per_depth=[0] * depths,
        compared_per_depth=[0] * depths,
        accepted_per_position=[0] * depths,
        vllm_drafts=after.drafts - before.drafts,
        vllm_accepted_per_position=[a - b for a, b in zip(after.per_pos, before.per_pos, strict=True)],
    )
    seen: list[set[int]] = [set() for _ in range(depths)]
    for prompt, (output, proposals) in zip(prompts, runs, strict=True):
        tokens = prompt + output
        ours = our_proposals(target, export, tokens, depths)
        accepted, steps = core_walk(tokens, len(prompt), ours, depths)
        c.core_walk_accepted, c.core_walk_steps = c.core_walk_accepted + accepted, c.core_walk_steps + steps
        anchor = len(prompt) - 1  # the first draft pairs the prefill's last state with the first output token
        for i, proposal in enumerate(proposals):
            if anchor > len(tokens) - 2:  # drafted after the step that reached max_tokens: never verified
                if i != len(proposals) - 1:
                    raise RuntimeError(f"proposals go on past the output of {len(tokens)} tokens")
                break
            n = 0  # leading tokens equal to the greedy continuation: what vLLM accepted
            while n < depths and anchor + 2 + n < len(tokens) and proposal[n] == tokens[anchor + 2 + n]:
                n += 1
            if i < len(proposals) - 1:  # verified by the next step (a reply's last proposal never is)
                c.steps += 1
                c.truncated_steps += n < depths and anchor + 2 + n == len(tokens)
                for d in range(n):
                    c.accepted_per_position[d] += 1
            for d, token in enumerate(proposal):
                c.drafted += 1
                seen[d].add(token)
                if (anchor, d) not in ours:
                    continue
                c.compared += 1
                c.compared_per_depth[d] += 1
                if ours[(anchor, d)] == token:
                    c.equal_per_depth[d] += 1
                elif len(c.mismatches) < 10:
                    c.mismatches.append(
                        {"anchor": anchor, "depth": d, "vllm": token, "ours": ours[(anchor, d)]}
                    )
            anchor += n + 1
    c.distinct_per_depth = [len(s) for s in seen]
    return c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="the target's HF model directory")
    ap.add_argument("--export", required=True, help="a P-EAGLE or EAGLE-3 export of a draft of that target")
    ap.add_argument("--depths", type=int, default=None, help="K (default: the export's speculative_tokens)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--prompts", default=None, help="a prompt set as `evaluate --prompts` takes (mt-bench, a JSONL)"
    )
    ap.add_argument("--num-prompts", type=int, default=80)
    args = ap.parse_args()
    from peagle_pipeline.stages.evaluate.acceptance import draft_depths, read_draft_config
    from peagle_pipeline.stages.evaluate.prompts import load_prompts

    depths = args.depths or draft_depths(read_draft_config(args.export))
    prompts = (
        load_prompts(args.prompts, args.target, args.num_prompts)
        if args.prompts
        else chat_prompts(args.target)
    )
    result = compare_proposals(args.target, args.export, prompts, depths, args.max_tokens)
    print(json.dumps(asdict(result)))


if __name__ == "__main__":
    main()
