"""The model card of an export: README.md beside config.json, ready for a model hub.

A YAML metadata header (`base_model` when the target's hub id is known, `library_name`, `tags`, the target's
`license` where its files state one), then what the draft is (method, layers, K trained and served, draft
vocabulary), what it was trained on (each cache's sources, samples, tokens, whether the replies are the target's
own, the chat-template variables), how (steps, global batch, lr, COD), the trainer's held-out estimate, the
`vllm serve` command and the upload command of the hub's own CLI. `evaluate` writes its measured table between the
MEASURED markers (`refresh_measured`). Everything comes from the run folder (train.yaml, run.json, draft.json,
metrics.jsonl), the export (config.json, its marker) and the caches' own records; a fact that cannot be read is
left out, never guessed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from peagle_pipeline.runtime import atomic_write_text
from peagle_pipeline.stages.export.card_facts import gather

__all__ = [
    "CARD_FILE",
    "MEASURED_BEGIN",
    "MEASURED_END",
    "card_text",
    "is_generated",
    "refresh_measured",
    "write_card",
]

CARD_FILE = "README.md"
GENERATED = (
    "<!-- written by peagle-pipeline export: a new export rewrites this file, evaluate its measured part -->"
)
MEASURED_BEGIN = "<!-- measured by peagle-pipeline evaluate: begin -->"
MEASURED_END = "<!-- measured by peagle-pipeline evaluate: end -->"
# method -> (its name, what it does, whether vLLM runs it with parallel drafting)
_METHODS = {
    "peagle": ("P-EAGLE", "parallel-drafting EAGLE-3: it drafts all K tokens in one forward pass", True),
    "eagle3": ("EAGLE-3", "it drafts one token per forward pass, K passes per verification", False),
}


def write_card(export_dir: str | os.PathLike[str], run_dir: str | os.PathLike[str]) -> Path:
    """Write EXPORT/README.md for the export of `run_dir` (replacing the one a previous export wrote)."""
    path = Path(export_dir) / CARD_FILE
    atomic_write_text(path, card_text(export_dir, run_dir))
    return path


def is_generated(export_dir: str | os.PathLike[str]) -> bool:
    """True when EXPORT/README.md is a card an export wrote (its marker line is there): a README of the user's
    own is never replaced or changed."""
    try:
        return GENERATED in (Path(export_dir) / CARD_FILE).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False


def refresh_measured(export_dir: str | os.PathLike[str], section: str) -> bool:
    """Put `section` between the MEASURED markers of the export's card (the markers appended when absent).

    Returns False, changing nothing, where the folder holds no card this package wrote (a README of its own)."""
    path = Path(export_dir) / CARD_FILE
    if not is_generated(export_dir):
        return False
    text = path.read_text(encoding="utf-8")
    block = f"{MEASURED_BEGIN}\n{section.strip()}\n{MEASURED_END}"
    start, end = text.find(MEASURED_BEGIN), text.find(MEASURED_END)
    if start != -1 and end > start:
        text = text[:start] + block + text[end + len(MEASURED_END) :]
    else:
        text = text.rstrip("\n") + "\n\n## Measured in vLLM\n\n" + block + "\n"
    atomic_write_text(path, text)
    return True


def card_text(export_dir: str | os.PathLike[str], run_dir: str | os.PathLike[str]) -> str:
    """The card of an export written from `run_dir` (see the module docstring)."""
    facts = gather(Path(export_dir), Path(run_dir))
    name, what, _ = _METHODS.get(facts.method, (facts.method, "", False))
    target = (
        f"[{facts.target_label}]({facts.target_link})" if facts.target_link else f"`{facts.target_label}`"
    )
    parts = [
        _front_matter(facts),
        GENERATED,
        "",
        f"# {name} draft for {facts.target_label}",
        "",
        f"A {name} speculative-decoding draft for {target}" + (f" ({what})" if what else "") + ", in the "
        "speculators format that vLLM loads, trained with peagle-pipeline from the target's own hidden states.",
        "",
        *_draft_section(facts),
        *_data_section(facts),
        *_training_section(facts),
        *_estimate_section(facts),
        *_serve_section(facts),
        "## Measured in vLLM",
        "",
        MEASURED_BEGIN,
        "Not measured yet: `peagle-pipeline evaluate` on this folder writes its table here "
        "(acceptance length per prompt set and position, speedup, hardware).",
        MEASURED_END,
        "",
        *_upload_section(facts),
    ]
    return "\n".join(parts).rstrip("\n") + "\n"


def _front_matter(facts: Any) -> str:
    import yaml

    meta: dict[str, Any] = {}
    if facts.base_model:
        meta["base_model"] = facts.base_model
    meta["library_name"] = "vllm"
    meta.update(facts.license)
    method_tag = {"peagle": "p-eagle"}.get(facts.method, facts.method)
    tags = list(
        dict.fromkeys(
            ["speculative-decoding", method_tag, "eagle3", "speculators", "vllm", "peagle-pipeline"]
        )
    )
    meta["tags"] = list(dict.fromkeys(tags))
    head = yaml.safe_dump(meta, sort_keys=False, allow_unicode=True)
    note = (
        ""
        if facts.base_model
        else f"# base_model: the target's model hub id (it was trained from the local folder {facts.target_label})\n"
    )
    return f"---\n{head}{note}---"


def _rows(pairs: list[tuple[str, Any]]) -> list[str]:
    lines = ["| | |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in pairs if v is not None and v != ""]
    return [*lines, ""]


def _draft_section(facts: Any) -> list[str]:
    spec = facts.spec
    vocab = f"{spec.draft_vocab_size:,} of the target's {spec.vocab_size:,} tokens"
    return [
        "## The draft",
        "",
        *_rows(
            [
                ("method", facts.method),
                ("target", f"`{facts.target_name}`"),
                ("draft layers", f"{spec.draft_layers} (the first fuses the target's hidden states)"),
                ("target layers read", ", ".join(map(str, spec.aux_layer_ids))),
                ("K trained / served", f"{spec.depths} / {facts.served_depths}"),
                ("draft vocabulary", vocab),
                ("checkpoint", f"{facts.checkpoint} (step {facts.step})" if facts.checkpoint else None),
            ]
        ),
    ]


def _data_section(facts: Any) -> list[str]:
    if not facts.caches:
        return ["## Training data", "", "The run's cache could not be read when this card was written.", ""]
    lines = [
        "## Training data",
        "",
        "| cache | samples | tokens | supervised tokens | replies | chat-template variables |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for c in facts.caches:
        policy = {True: "the target's own (on-policy)", False: "from the data (off-policy)"}.get(
            c.on_policy, "-"
        )
        variables = json.dumps(c.template_kwargs) if c.template_kwargs else "none"
        lines.append(
            f"| {c.role} | {c.samples:,} | {c.tokens:,} | {c.supervised:,} | {policy} | `{variables}` |"
        )
    lines.append("")
    for c in facts.caches:
        shown = ", ".join(f"`{name}` ({count:,} samples)" for name, count in c.sources)
        lines.append(f"Sources of the {c.role} cache: {shown}.")
    return [*lines, ""]


def _training_section(facts: Any) -> list[str]:
    t = facts.train
    cod = (
        f"down_sample_ratio {t.get('down_sample_ratio')}, min {t.get('down_sample_ratio_min')}, "
        f"max_anchors {t.get('max_anchors')}"
    )
    batch = facts.global_batch
    return [
        "## Training",
        "",
        *_rows(
            [
                (
                    "optimizer steps",
                    f"{facts.step:,} of {facts.total_steps:,}" if facts.total_steps else facts.step,
                ),
                (
                    "global batch",
                    None
                    if batch is None
                    else f"{batch:,} tokens (tokens_per_step {t.get('tokens_per_step')} x "
                    f"{facts.world_size} rank(s) x grad_accum {t.get('grad_accum', 1)})",
                ),
                ("learning rate", f"{t.get('lr')} ({t.get('schedule')}, {t.get('warmup')} warm-up steps)"),
                ("COD sampling", cod),
                (
                    "loss",
                    f"KL to the target's next-token distribution ({t.get('target')}), {t.get('loss_positions')} "
                    "positions",
                ),
                ("precision", t.get("precision")),
                ("seed", t.get("seed")),
            ]
        ),
    ]


def _estimate_section(facts: Any) -> list[str]:
    e = facts.estimate
    if not e:
        return []
    walk = "" if e.get("acceptance_walk") is None else f", vLLM's walk {e['acceptance_walk']:.3f}"
    agree = " ".join("-" if a is None else f"{a:.2f}" for a in e.get("agreement") or [])
    acc = e.get("acceptance")
    return [
        "## The trainer's estimate",
        "",
        f"On held-out samples at step {e['step']}: acceptance length {'-' if acc is None else f'{acc:.3f}'}"
        f"{walk}; top-1 agreement per depth {agree}; loss {e.get('loss', float('nan')):.4f}. An estimate from the "
        "cache, not a measurement: the measured table below is vLLM's.",
        "",
    ]


def _serve_section(facts: Any) -> list[str]:
    config: dict[str, Any] = {"model": facts.draft_ref, "method": "eagle3"}
    if _METHODS.get(facts.method, ("", "", True))[2]:
        config["parallel_drafting"] = True
    config["num_speculative_tokens"] = facts.served_depths
    return [
        "## Serve with vLLM",
        "",
        "```bash",
        f"vllm serve {facts.serve_target} \\",
        f"  --speculative-config '{json.dumps(config)}'",
        "```",
        "",
        f"`{facts.draft_ref}`: this folder, or its hub id once uploaded.",
        "",
    ]


def _upload_section(facts: Any) -> list[str]:
    return [
        "## Upload",
        "",
        "With the hub's own CLI (`pip install huggingface_hub`, then `hf auth login`):",
        "",
        "```bash",
        f"hf upload YOUR-NAMESPACE/{facts.repo_name} {facts.export_dir} . --exclude .peagle-export.json",
        "```",
        "",
        "`.peagle-export.json` names the local run it came from; vLLM does not need it.",
    ]
