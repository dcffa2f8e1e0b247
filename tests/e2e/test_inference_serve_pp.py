"""``kolossos serve MODEL_DIR --pp 2`` as a real process (2 pipeline stages, continuous batching):
concurrent, staggered ``/v1/completions`` requests with ``temperature: 0`` (one streaming) get
transformers' greedy text; after SIGTERM both ranks exit, rank 0 with status 0.

The waits are hang detectors (minutes), not stopwatches.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("tokenizers")
from test_inference_serve_tp import (
    HANG_S,
    alive,
    build_folder,
    call,
    children_of,
    expected_text,
    free_port,
)

pytestmark = pytest.mark.dist

PROMPTS = ["w5 w6 w7", "w1 w2 w3 w4 w5 w6", "w9", "w40 w41 w42 w43"]


@contextmanager
def serving(
    args: list[str], log: Path, port: int | None = None
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Start ``kolossos serve ARGS --port P`` (``port`` given: ARGS set it); yield its base URL
    once ``/health`` says ok. Killed on the way out if it is still running."""
    if port is None:
        port = free_port()
        args = [*args, "--port", str(port)]
    command = [sys.executable, "-m", "kolossos.cli.main", "serve", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("w") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + HANG_S
            while True:
                assert server.poll() is None, log.read_text()
                assert time.monotonic() < deadline, f"kolossos serve {args} did not come up"
                try:
                    if call(f"{base}/health")["status"] == "ok":
                        break
                except (urllib.error.URLError, ConnectionError):
                    time.sleep(0.2)
            yield base, server
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()


def stream_text(url: str, body: dict[str, object]) -> str:
    """The concatenated ``text`` deltas of a streamed completion."""
    data = json.dumps({**body, "stream": True}).encode()
    request = urllib.request.Request(url, data, {"content-type": "application/json"})
    text = ""
    with urllib.request.urlopen(request, timeout=HANG_S) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def greedy_texts(base: str, folder: Path) -> None:
    """Four concurrent staggered greedy requests (the last one streamed) get ``generate``'s text."""

    def complete(i: int) -> str:  # concurrent: later requests join running batches
        time.sleep(0.05 * i)
        body = {"prompt": PROMPTS[i], "max_tokens": 8 + i, "temperature": 0}
        if i == len(PROMPTS) - 1:
            return stream_text(f"{base}/v1/completions", body)
        text: str = call(f"{base}/v1/completions", body)["choices"][0]["text"]
        return text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(complete, range(len(PROMPTS))))
    assert got == [expected_text(folder, p, 8 + i) for i, p in enumerate(PROMPTS)]


def stop_and_check(server: subprocess.Popen[bytes], ranks: list[int], log: Path) -> None:
    """SIGTERM to rank 0: it exits with status 0 and every other rank is gone."""
    server.send_signal(signal.SIGTERM)
    assert server.wait(timeout=HANG_S) == 0, log.read_text()
    deadline = time.monotonic() + HANG_S
    while any(alive(pid) for pid in ranks):
        assert time.monotonic() < deadline, f"rank processes {ranks} still running"
        time.sleep(0.1)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_pp2_serve_equals_generate_then_every_rank_exits(tmp_path: Path) -> None:
    folder = tmp_path / "tiny-gpt2"
    build_folder(folder)
    log = tmp_path / "serve.log"
    with serving([str(folder), "--pp", "2", "--cache-size", "0"], log) as (base, server):
        ranks = children_of(server.pid)
        assert len(ranks) == 1, ranks  # rank 1: the second stage
        greedy_texts(base, folder)
        stop_and_check(server, ranks, log)
