"""Generate docs/reference/pipeline-files.md and docs/reference/cli.md from the config dataclasses and the CLI (the one source of truth).

Usage: python scripts/gen_docs.py [--check]   (--check exits 1 when the committed docs are stale)
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

from peagle_pipeline.config import ExtractConfig, GenerateConfig, TrainConfig, describe_fields, is_required

DOCS = Path(__file__).resolve().parents[1] / "docs" / "reference"


def _table(cls: type) -> str:
    rows = ["| key / flag | default | meaning |", "|---|---|---|"]
    for name, help_text, default in describe_fields(cls):
        flag = "--" + name.replace("_", "-")
        shown = (
            "(required)" if is_required(cls, name) else "(none)" if default in ("", []) else f"`{default}`"
        )
        rows.append(f"| `{name}` / `{flag}` | {shown} | {help_text} |")
    return "\n".join(rows)


def pipeline_files_md() -> str:
    return f"""# Pipeline files

A pipeline file is YAML with up to three sections, `generate:`, `extract:` and `train:`. Keys are the command-line flag names with
`_` (a `-` spelling is accepted too). Precedence: built-in default < pipeline file < flag. Unknown keys are refused
with the closest valid name. The resolved settings are written next to the output (`generate.json` in the generate
output, `extract.yaml` in the cache, `train.yaml` in the run directory) and are what a resume is compared against.

Generated from `peagle_pipeline/config/` (one module per command) by `scripts/gen_docs.py`; do not edit by hand.

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


def _options(command: str) -> str:
    """The arguments and options of one CLI command as a table, from its typer definition."""
    import typer.main

    from peagle_pipeline.cli import app

    rows = ["| argument / flag | default | meaning |", "|---|---|---|"]
    for p in typer.main.get_command(app).commands[command].params:
        if p.param_type_name == "argument":
            name, shown = f"`{p.name.upper()}{'...' if p.nargs == -1 else ''}`", "(required)"
        else:
            name = f"`{' / '.join(p.opts + p.secondary_opts)}`" + (" (repeatable)" if p.multiple else "")
            shown = "-" if p.default is None else f"`{p.default}`"
        rows.append(f"| {name} | {shown} | {(p.help or '').replace('|', '/')} |")
    return "\n".join(rows)


def cli_md() -> str:
    return """# Command-line reference

Every command prints a one-line `error: ...` and exits non-zero on a user mistake (set `PEAGLE_DEBUG=1` for the
traceback). Exit codes: 1 generic, 2 bad input or settings, 3 incompatible or incomplete cache, 4 corrupt data,
5 resume with other settings, 6 output directory holds something else, 7 another process holds the lock of that
extraction rank or training run,
8 repeated non-finite loss, 9 disk full, 10 a target runtime returned other tokens or shapes than sent, 11 speculative
greedy output differs from plain greedy output (`vllm-check`), 12 the object store holding a cache did not answer a
read (the cache is not damaged; run again, `train --resume`), 13 another rank of a distributed training run died
(`train --resume` continues from the last checkpoint), 130 interrupted (Ctrl-C), 143 terminated (SIGTERM). Under
torchrun, torchrun itself exits 1 whenever a rank fails; `train --nproc-per-node N` starts the ranks of one machine
itself and exits with these codes ([multi-node](../guides/multi-node.md#training-ddp-and-fsdp)).

| command | what it does |
|---|---|
| `peagle-pipeline generate [--config FILE] [flags]` | regenerate the assistant replies of chat data with the target (on-policy rows with their token ids; see [generate.md](../guides/generate.md)); write or resume (section `generate:`) |
| `peagle-pipeline extract [--config FILE] [flags]` | run the target once over chat data, write or resume a cache (flags: see [pipeline-files.md](pipeline-files.md), section `extract:`) |
| `peagle-pipeline inspect CACHE [--sample ID] [--rows N]` | settings, samples, tokens, supervised fraction, lengths, bytes per token, store sizes; or one sample token by token |
| `peagle-pipeline verify CACHE` | read everything back, check checksums and tables; names the store and samples of each problem (exit 4); checks what the manifests commit, so a cache still being written is reported incomplete (exit 3), not damaged |
| `peagle-pipeline train [--config FILE] [flags]` | train a draft from a cache (section `train:`); `--resume` continues exactly; `--nproc-per-node N` trains with N ranks on this machine |
| `peagle-pipeline export RUN --output DIR [--checkpoint best\\|latest\\|step-N] [--force]` | speculators P-EAGLE checkpoint for vLLM (`--force`: replace another run's export) |
| `peagle-pipeline plot RUN` | PNG curves of loss, per-depth agreement and acceptance length |
| `peagle-pipeline evaluate DRAFT... [--prompts SET]...` | measure drafts in vLLM side by side: acceptance length, per-position acceptance, tokens/s with and without the draft; JSON report and PNG chart ([evaluate.md](../guides/evaluate.md)) |
| `peagle-pipeline vllm-check DRAFT --target MODEL` | load target + draft in vLLM, check greedy equality, report vLLM's acceptance |

Rank and world size for `generate` and `extract` also come from `RANK`/`WORLD_SIZE` (torchrun) or `SLURM_PROCID`/`SLURM_NTASKS`.
`evaluate` and `vllm-check` run where vLLM is installed (`make setup-vllm`, then `.venv-vllm/bin/peagle-pipeline`).

`peagle-pipeline --version` prints the version.

## Every command's `--help`

Each option of a config field shows its default and, for a choice, the allowed values; `[required: flag or
pipeline file]` marks a setting that has no default.
""" + "".join(f"\n### `{name}`\n\n```\n{_help(name)}```\n" for name in _commands())


def _commands() -> list[str]:
    from peagle_pipeline.cli import app

    return [c.name or c.callback.__name__.replace("_", "-") for c in app.registered_commands]  # type: ignore[union-attr]


def _help(command: str) -> str:
    """`peagle-pipeline COMMAND --help` at a fixed width (the generated file must not depend on the terminal)."""
    from peagle_pipeline.cli import main

    os.environ["COLUMNS"] = "110"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main([command, "--help"])
    return out.getvalue()


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
