#!/usr/bin/env bash
# A Python 3.12 venv, .venv-gpu312, holding what a typical CUDA machine holds of what our GPU scripts import, at its
# versions (MACHINE below: set them to the GPU machine's), and no zarr stack: the scripts' install steps and their CPU
# rehearsals (experiments/gpu_profile.sh with REHEARSE=1, experiments/gpu_quality.sh with DEVICE=cpu) then meet what
# they will meet there, before GPU time is spent. PyPI's torch 2.11.0 wheel is the CUDA build (about 3 GB with its
# libraries); it runs on a CPU.
#     bash scripts/gpu_rehearsal_env.sh        (PYTHON312=... when python3.12 is not on the PATH)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-gpu312}
PY312=""
for c in ${PYTHON312:-} python3.12 $(ls -d "$HOME"/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null); do
  if "$c" --version >/dev/null 2>&1; then PY312=$c && break; fi  # (a pyenv shim exists but may not run)
done
[[ -n $PY312 ]] || { echo "error: no python3.12 that runs: set PYTHON312" >&2; exit 2; }
MACHINE=(torch==2.11.0 transformers==5.17.0 huggingface_hub==1.33.0 tokenizers==0.23.2 safetensors==0.8.0
  numpy==2.5.2 accelerate==1.15.0 pyarrow pandas typer pyyaml jinja2 matplotlib tensorboard tqdm rich psutil aiohttp
  xxhash requests pytest "setuptools>=77" wheel)
"$PY312" -m venv --clear "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q "${MACHINE[@]}"
"$VENV/bin/python" -c "import torch, transformers; print('rehearsal env:', torch.__version__, transformers.__version__)"
