#!/usr/bin/env bash
# Run HERE (a machine with PyPI): put into .whl/ what the GPU machine lacks, for scripts/gpu_tier.sh there.
# The lent GPU machines have python3 3.12 with CUDA torch 2.11, transformers and most of our dependencies, but no
# zarr stack and nothing can be fetched there (docs/gpu.md). --speculators adds speculators==0.9.0 and its import
# chain (as `make setup-bench` installs it) for the our-step-vs-speculators figure.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mkdir -p .whl
dl() {
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$@"
}
# The zarr stack, at the versions of constraints/cpu.txt.
dl -c constraints/cpu.txt zarr numcodecs donfig google-crc32c zstandard
if [[ "${1:-}" == "--speculators" ]]; then
  # What `make setup-bench` adds beside speculators (its metadata also wants torchvision/torchaudio: never
  # installed), plus their own needs that the GPU image lacks. Not yet tried on a GPU machine.
  dl speculators==0.9.0 "pydantic>=2,<3" pydantic-core "pydantic-settings>=2" "loguru>=0.7.2,<=0.7.3" \
    typing-inspection annotated-types python-dotenv "openai>=2" distro jiter sniffio "datasets>=4,<=5.1.0" \
    dill multiprocess hs-connectors==0.9.0
fi
# Our package as a wheel, built from a copy of the sources (the checkout gets no build/ folder).
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
cp -r pyproject.toml README.md peagle_pipeline "$src/"
rm -f .whl/peagle_pipeline-*.whl
"$PY" -m pip wheel -q --no-deps --no-build-isolation --no-index -w .whl "$src"
ls -la .whl
du -sh .whl
