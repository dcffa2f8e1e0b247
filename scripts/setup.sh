#!/usr/bin/env bash
# Set up a development environment in ./.venv (idempotent; seconds when already done).
# On a machine without torch this pins torch==2.13.0 first, so pip takes the CPU wheel that lies on
# disk here instead of pulling a multi-GB CUDA build for the open `torch>=` range.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${KOLOSSOS_VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating $VENV"
    "$PY" -m venv "$VENV"
fi
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip() { "$VENV/bin/python" -m pip "$@"; }
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    echo "[setup] installing torch==2.13.0 (CPU wheel)"
    pip install -q "torch==2.13.0" numpy
fi
NEEDED="kolossos, pytest, ruff, mypy, transformers, safetensors, matplotlib, fastapi, uvicorn, httpx, pyarrow, datasets, tensorboard, scipy"
if ! "$VENV/bin/python" -c "import $NEEDED" >/dev/null 2>&1; then
    echo "[setup] installing kolossos with the hf, train, dev, serve, data and auto extras"
    pip install -q -e ".[hf,train,dev,serve,data,auto]"
fi
echo "[setup] ready: $("$VENV/bin/python" -c 'import torch, kolossos; print("kolossos", kolossos.__version__, "torch", torch.__version__)')"
