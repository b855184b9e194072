"""Generate docs/pipeline-files.md and docs/cli.md from the config dataclasses (the one source of truth).

Usage: python scripts/gen_docs.py [--check]   (--check exits 1 when the committed docs are stale)
"""

from __future__ import annotations

import sys
from pathlib import Path

from peagle_pipeline.config import ExtractConfig, GenerateConfig, TrainConfig, describe_fields

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _table(cls: type) -> str:
    rows = ["| key / flag | default | meaning |", "|---|---|---|"]
    for name, help_text, default in describe_fields(cls):
        flag = "--" + name.replace("_", "-")
        shown = "(required)" if default in ("", []) else f"`{default}`"
        rows.append(f"| `{name}` / `{flag}` | {shown} | {help_text} |")
    return "\n".join(rows)


def pipeline_files_md() -> str:
    return f"""# Pipeline files

A pipeline file is YAML with up to three sections, `generate:`, `extract:` and `train:`. Keys are the command-line flag names with
`_` (a `-` spelling is accepted too). Precedence: built-in default < pipeline file < flag. Unknown keys are refused
with the closest valid name. The resolved settings are written next to the output (`generate.json` in the generate
output, `extract.yaml` in the cache, `train.yaml` in the run directory) and are what a resume is compared against.

Generated from `peagle_pipeline/config.py` by `scripts/gen_docs.py`; do not edit by hand.

```yaml
generate:
  model: .demo/models/SmolLM2-135M-Instruct
  data: [.demo/data/sharegpt.jsonl]
  output: .demo/onpolicy
extract:
  model: .demo/models/SmolLM2-135M-Instruct
  data: [.demo/data/sharegpt.jsonl]
  output: .demo/cache
train:
  cache: .demo/cache
  output: .demo/run
  depths: 4
```

## `generate:`

{_table(GenerateConfig)}

## `extract:`

{_table(ExtractConfig)}

## `train:`

{_table(TrainConfig)}
"""


def cli_md() -> str:
    return """# Command-line reference

Every command prints a one-line `error: ...` and exits non-zero on a user mistake (set `PEAGLE_DEBUG=1` for the
traceback). Exit codes: 1 generic, 2 bad input or settings, 3 incompatible or incomplete cache, 4 corrupt data,
5 resume with other settings, 6 output directory holds something else, 7 another process holds the rank lock,
8 repeated non-finite loss, 9 disk full, 10 a target runtime returned other tokens or shapes than sent, 11 speculative
greedy output differs from plain greedy output (`vllm-check`), 130 interrupted.

| command | what it does |
|---|---|
| `peagle-pipeline generate [--config FILE] [flags]` | regenerate the assistant replies of chat data with the target (on-policy rows with their token ids; see [generate.md](generate.md)); write or resume (section `generate:`) |
| `peagle-pipeline extract [--config FILE] [flags]` | run the target once over chat data, write or resume a cache (flags: see [pipeline-files.md](pipeline-files.md), section `extract:`) |
| `peagle-pipeline inspect CACHE [--sample ID] [--rows N]` | settings, samples, tokens, supervised fraction, lengths, bytes per token, store sizes; or one sample token by token |
| `peagle-pipeline verify CACHE` | read everything back, check checksums and tables; names the store and samples of each problem (exit 4) |
| `peagle-pipeline train [--config FILE] [flags]` | train a draft from a cache (section `train:`); `--resume` continues exactly |
| `peagle-pipeline export RUN --output DIR [--checkpoint best\\|latest\\|step-N]` | speculators P-EAGLE checkpoint for vLLM |
| `peagle-pipeline plot RUN` | PNG curves of loss, per-depth agreement and acceptance length |
| `peagle-pipeline vllm-check DRAFT --target MODEL` | load target + draft in vLLM, check greedy equality, report vLLM's acceptance |

Rank and world size for `generate` and `extract` also come from `RANK`/`WORLD_SIZE` (torchrun) or `SLURM_PROCID`/`SLURM_NTASKS`.
"""


def main() -> int:
    outputs = {DOCS / "pipeline-files.md": pipeline_files_md(), DOCS / "cli.md": cli_md()}
    if "--check" in sys.argv:
        stale = [p.name for p, text in outputs.items() if not p.exists() or p.read_text() != text]
        if stale:
            print(f"stale docs: {', '.join(stale)}; run python scripts/gen_docs.py")
            return 1
        return 0
    for path, text in outputs.items():
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
