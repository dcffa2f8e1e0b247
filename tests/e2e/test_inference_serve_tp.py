"""``kolossos serve MODEL_DIR --tp 2`` as a real process: it answers ``/v1/completions`` with
transformers' greedy tokens, and after SIGTERM (or SIGINT) to rank 0 both ranks exit, rank 0 with
status 0: no leaked rank process.

The waits are hang detectors (minutes), not stopwatches.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("tokenizers")
import transformers as tf
from tokenizers import Tokenizer, models, pre_tokenizers

pytestmark = pytest.mark.dist

HANG_S = 300.0


def build_folder(folder: Path) -> None:
    """A GPT-2 (4 heads: splittable over 2 ranks) and a word-level tokenizer ``w1 .. w98``."""
    torch.manual_seed(0)
    config = tf.GPT2Config(
        vocab_size=100, n_positions=32, n_embd=32, n_layer=2, n_head=4,
        initializer_range=0.5, bos_token_id=99, eos_token_id=99, pad_token_id=0,
    )  # fmt: skip
    tf.GPT2LMHeadModel(config).save_pretrained(folder)
    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, 99)}, "<eos>": 99}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = tf.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>", pad_token="<unk>"
    )
    tokenizer.save_pretrained(folder)


def expected_text(folder: Path, prompt: str, max_tokens: int) -> str:
    model = tf.AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = tf.AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor([tokenizer.encode(prompt)])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                         do_sample=False)  # fmt: skip
    new = out[0, ids.shape[1] :].tolist()
    new = new[: new.index(99)] if 99 in new else new
    text: str = tokenizer.decode(new, skip_special_tokens=True)
    return text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def children_of(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def call(url: str, body: Any | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=HANG_S) as response:
        return json.loads(response.read())


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_tp2_serve_answers_then_every_rank_exits(tmp_path: Path, stop_signal: int) -> None:
    folder = tmp_path / "tiny-gpt2"
    build_folder(folder)
    port = free_port()
    log = (tmp_path / "serve.log").open("w")
    command = [sys.executable, "-m", "kolossos.cli.main", "serve", str(folder), "--tp", "2",
               "--port", str(port), "--cache-size", "0"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + HANG_S
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, "kolossos serve --tp 2 did not come up"
            try:
                if call(f"{base}/health")["status"] == "ok":
                    break
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.2)
        ranks = children_of(server.pid)
        assert len(ranks) == 1, ranks  # rank 1
        prompts = ["w5 w6 w7", "w1 w2 w3 w4 w5 w6", "w9", "w40 w41 w42 w43"]

        def complete(i: int) -> str:  # concurrent: later requests join running batches
            time.sleep(0.05 * i)
            body = {"prompt": prompts[i], "max_tokens": 8 + i, "temperature": 0}
            text: str = call(f"{base}/v1/completions", body)["choices"][0]["text"]
            return text

        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(complete, range(len(prompts))))
        assert got == [expected_text(folder, p, 8 + i) for i, p in enumerate(prompts)]
        server.send_signal(stop_signal)
        assert server.wait(timeout=HANG_S) == 0, (tmp_path / "serve.log").read_text()
        deadline = time.monotonic() + HANG_S
        while any(alive(pid) for pid in ranks):
            assert time.monotonic() < deadline, f"rank processes {ranks} still running"
            time.sleep(0.1)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        log.close()
