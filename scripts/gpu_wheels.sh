#!/usr/bin/env bash
# On a machine with network: put into .whl/ what a CUDA machine without network lacks, for scripts/gpu_tier.sh and
# experiments/gpu_quality.sh there (the zarr stack, gguf, our package as a wheel), and with --speculators the
# benchmark comparator's wheels into .whl-speculators/ (a folder of its own, so that .whl stays small, about 16 MB).
# The GPU machine is taken to have a python3 with CUDA torch (GPU_TORCH), transformers and most of our dependencies;
# PY_VERSION and the platform tags below say which wheels fit it (docs/guides/gpus.md). --speculators adds
# speculators==0.9.0 and everything its requirements pull in (resolved here), less torch with its CUDA stack and less
# what our package requires directly (the GPU machine has those, or .whl holds them); the versions there may differ,
# so their own requirements come too (openai 3 needs httpx2, which a GPU machine may lack).
# .whl-speculators/speculators-carry.txt lists them (speculators included); gpu_tier.sh installs those the machine
# lacks. Any python3 with pip runs it (PYTHON=...): our wheel is built in pip's isolated build env.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
GPU_TORCH=${GPU_TORCH:-2.11.0}  # the GPU machine's torch, taken as given when resolving
SPW=${BENCH_WHEELS:-.whl-speculators}
rm -rf .whl && mkdir -p .whl  # nothing stale travels
PY_VERSION=${PY_VERSION:-3.12}  # the GPU machine's python3
TARGET=(--only-binary=:all: --python-version "$PY_VERSION" --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
dl() { local dest=$1; shift; "$PY" -m pip download -q --no-deps "${TARGET[@]}" -d "$dest" "$@"; }
# What `pip install` would install on the GPU machine's Python (nothing installed; only resolved) -> report $1.
resolve() { "$PY" -m pip install -q --dry-run --ignore-installed "${TARGET[@]}" --target "$work/t" --report "$@"; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The zarr stack, at the versions of constraints/cpu.txt.
dl .whl -c constraints/cpu.txt zarr numcodecs donfig google-crc32c zstandard
# gguf: experiments/gpu_quality.sh rebuilds SmolLM2 on the GPU machine from its GGUF (scripts/prepare_demo.py).
dl .whl gguf==0.19.0
# Our package as a wheel, built from a copy of the sources (the checkout gets no build/ folder) in pip's isolated
# build environment (setuptools >= 77 for the SPDX license string, whatever this python3 has).
cp -r pyproject.toml README.md peagle_pipeline "$work/"
"$PY" -m pip wheel -q --no-deps -w .whl "$work"
if [[ "${1:-}" == "--speculators" ]]; then
  rm -rf "$SPW" && mkdir -p "$SPW"
  dl "$SPW" speculators==0.9.0
  # Its metadata also wants torchvision/torchaudio, which its P-EAGLE model never imports: never downloaded.
  "$PY" scripts/wheel_closure.py requires "$SPW"/speculators-0.9.0-py3-none-any.whl \
    --drop torch,torchvision,torchaudio > "$work/spec.txt"
  torch_stub=$("$PY" scripts/wheel_closure.py stub torch "$GPU_TORCH" "$work")
  resolve "$work/spec.json" -r "$work/spec.txt" "$torch_stub"
  "$PY" scripts/wheel_closure.py requires .whl/peagle_pipeline-*.whl > "$work/ours.txt"
  { echo speculators==0.9.0; "$PY" scripts/wheel_closure.py carry "$work/spec.json" --minus "$work/ours.txt"; } \
    > "$SPW"/speculators-carry.txt
  echo "speculators carries: $(tr '\n' ' ' < "$SPW"/speculators-carry.txt)"
  dl "$SPW" -r "$SPW"/speculators-carry.txt
  du -sh "$SPW"
fi
ls -la .whl
du -sh .whl
