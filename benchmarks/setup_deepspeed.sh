#!/usr/bin/env bash
# Create the benchmark environment .venv-bench: DeepSpeed 0.19.8 and matplotlib on top of the
# project's .venv, whose packages (torch, transformers, kolossos in editable mode) it shares through
# a site .pth file, so nothing in .venv changes and torch is not downloaded twice. Idempotent.
#   bash benchmarks/setup_deepspeed.sh && .venv-bench/bin/python -m benchmarks deepspeed
# The first DeepSpeed start on the CPU JIT-compiles a shared-memory comm op (~2 min, cached in
# ~/.cache/torch_extensions); DS_BUILD_OPS=0 keeps the install itself to seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
MAIN=${KOLOSSOS_VENV:-.venv}
BENCH=${KOLOSSOS_BENCH_VENV:-.venv-bench}
[ -x "$MAIN/bin/python" ] || bash scripts/setup.sh
if [ ! -x "$BENCH/bin/python" ]; then
    echo "[bench] creating $BENCH"
    "$("$MAIN/bin/python" -c 'import sys; print(sys._base_executable)')" -m venv "$BENCH"
fi
printf '*\n' >"$BENCH/.gitignore" # keep git, ruff and CI away from it
site_of() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
main_site=$(cd "$(site_of "$MAIN")" && pwd)
echo "import site; site.addsitedir('$main_site')" >"$(site_of "$BENCH")/_kolossos_main_venv.pth"
export PIP_DISABLE_PIP_VERSION_CHECK=1 DS_BUILD_OPS=0
if ! "$BENCH/bin/python" -c "import deepspeed, matplotlib" >/dev/null 2>&1; then
    echo "[bench] installing deepspeed==0.19.8 and matplotlib into $BENCH"
    "$BENCH/bin/python" -m pip install -q setuptools wheel  # build deps: --no-build-isolation
    "$BENCH/bin/python" -m pip install -q "deepspeed==0.19.8" matplotlib --no-build-isolation
fi
DS_ACCELERATOR=cpu "$BENCH/bin/python" -c \
    'import deepspeed, torch, kolossos; print("[bench] ready: deepspeed", deepspeed.__version__, "torch", torch.__version__)'
