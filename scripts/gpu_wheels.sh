#!/usr/bin/env bash
# Run HERE (a machine with PyPI): put into .whl/ what the GPU machine lacks, for scripts/gpu_tier.sh there, and with
# --speculators the comparator's wheels into .whl-speculators/ (a folder of its own: .whl then stays small enough,
# about 16 MB, to travel beside half the GGUF of experiments/gpu_quality.sh within one call's 64 MiB).
# The lent GPU machines have python3 3.12 with CUDA torch 2.11, transformers and most of our dependencies, but no
# zarr stack and nothing can be fetched there (docs/guides/gpus.md). --speculators adds speculators==0.9.0 and everything
# its requirements pull in on Python 3.12 (resolved here), less torch with its CUDA stack and less what our package
# requires directly (the GPU machine has those, or they are carried already); the versions there may differ, so
# their own requirements are carried (openai 3 needs httpx2, which the GPU machine lacks).
# .whl-speculators/speculators-carry.txt lists them (speculators included); gpu_tier.sh installs those the machine lacks. Any python3 with pip runs it (PYTHON=...): our wheel is built in pip's isolated build env.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
GPU_TORCH=${GPU_TORCH:-2.11.0}  # the GPU machine's torch, taken as given when resolving
SPEC=${SPEC_WHEELS:-.whl-speculators}
rm -rf .whl && mkdir -p .whl  # nothing stale travels
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
dl() { local dest=$1; shift; "$PY" -m pip download -q --no-deps "${TARGET[@]}" -d "$dest" "$@"; }
# What `pip install` would install on a Python 3.12 machine (nothing installed; only resolved) -> report $1.
resolve() { "$PY" -m pip install -q --dry-run --ignore-installed "${TARGET[@]}" --target "$work/t" --report "$@"; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The zarr stack, at the versions of constraints/cpu.txt.
dl .whl -c constraints/cpu.txt zarr numcodecs donfig google-crc32c zstandard
# gguf: experiments/gpu_quality.sh rebuilds SmolLM2 there from its GGUF (scripts/prepare_demo.py).
dl .whl gguf==0.19.0
# Our package as a wheel, built from a copy of the sources (the checkout gets no build/ folder) in pip's isolated
# build environment (setuptools >= 77 for the SPDX license string, whatever this python3 has).
cp -r pyproject.toml README.md peagle_pipeline "$work/"
"$PY" -m pip wheel -q --no-deps -w .whl "$work"
if [[ "${1:-}" == "--speculators" ]]; then
  rm -rf "$SPEC" && mkdir -p "$SPEC"
  dl "$SPEC" speculators==0.9.0
  # Its metadata also wants torchvision/torchaudio, which its P-EAGLE model never imports: never carried.
  "$PY" scripts/wheel_closure.py requires "$SPEC"/speculators-0.9.0-py3-none-any.whl \
    --drop torch,torchvision,torchaudio > "$work/spec.txt"
  torch_stub=$("$PY" scripts/wheel_closure.py stub torch "$GPU_TORCH" "$work")
  resolve "$work/spec.json" -r "$work/spec.txt" "$torch_stub"
  "$PY" scripts/wheel_closure.py requires .whl/peagle_pipeline-*.whl > "$work/ours.txt"
  { echo speculators==0.9.0; "$PY" scripts/wheel_closure.py carry "$work/spec.json" --minus "$work/ours.txt"; } \
    > "$SPEC"/speculators-carry.txt
  echo "speculators carries: $(tr '\n' ' ' < "$SPEC"/speculators-carry.txt)"
  dl "$SPEC" -r "$SPEC"/speculators-carry.txt
  du -sh "$SPEC"
fi
ls -la .whl
du -sh .whl
