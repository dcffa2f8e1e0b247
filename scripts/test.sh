#!/usr/bin/env bash
# The whole test suite: set-up, lint, format check, types, tests. Exits non-zero on any failure,
# including "no tests collected" (pytest exit code 5).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The two-node launcher test needs an OpenSSH server; install it where we are allowed to.
if ! [ -x /usr/sbin/sshd ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[test] installing openssh-server for the multi-node launcher test"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server) \
        >/dev/null 2>&1 || echo "[test] could not install openssh-server: that test will skip"
fi
VENV=${KOLOSSOS_VENV:-.venv}
export PATH="$PWD/$VENV/bin:$PATH" OMP_NUM_THREADS=1
echo "[test] ruff"; ruff check . && ruff format --check .
echo "[test] mypy"; mypy
echo "[test] pytest"; pytest -q "$@"
