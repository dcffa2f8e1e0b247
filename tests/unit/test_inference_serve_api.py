"""``kolossos serve``'s HTTP API on one process against a tiny GPT-2 folder built here.

FastAPI's ``TestClient``: greedy ``/v1/completions`` (``temperature: 0``) equals transformers'
``generate``, for one prompt and a list; streaming (server-sent events) gives the same text;
``stop`` strings; the result cache; every kind of bad request is a 4xx with a message.

A load test on loopback with a real HTTP client (``httpx.AsyncClient`` against uvicorn on a free
port): concurrent streaming requests, some malformed, some cancelled mid-stream. Every valid
request must get exactly its greedy text, every bad one a clean 4xx, and the server must be idle
afterwards (cancelled rows left the batch).
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
pytest.importorskip("tokenizers")
import httpx
import transformers as tf
import uvicorn
from fastapi.testclient import TestClient
from tokenizers import Tokenizer, models, pre_tokenizers

from kolossos.inference import InferenceEngine
from kolossos.inference.batching import BatchingConfig
from kolossos.inference.http_api import ApiLimits, create_app
from kolossos.inference.scheduler import Scheduler

CONTEXT = 32


def build_folder(folder: Path) -> None:
    """A GPT-2 (vocabulary 100, EOS 99) and a word-level tokenizer ``w1 .. w98``."""
    torch.manual_seed(0)
    config = tf.GPT2Config(
        vocab_size=100, n_positions=CONTEXT, n_embd=16, n_layer=2, n_head=2,
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


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-gpt2")
    build_folder(path)
    return path


def expected_text(folder: Path, prompt: str, max_tokens: int) -> str:
    """transformers' greedy ``generate``, decoded as the server decodes (EOS dropped)."""
    model = tf.AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = tf.AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor([tokenizer.encode(prompt)])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                         do_sample=False)  # fmt: skip
    new = out[0, ids.shape[1] :].tolist()
    new = new[: new.index(99)] if 99 in new else new
    text: str = tokenizer.decode(new, skip_special_tokens=True)
    return text


def make_app(folder: Path, timeout_s: float = 60.0, **batching: Any) -> tuple[Any, Scheduler]:
    config = BatchingConfig(**{"cache_size": 0, **batching})
    scheduler = Scheduler(InferenceEngine(folder), config, idle_wait_s=0.05)
    tokenizer = tf.AutoTokenizer.from_pretrained(folder)
    limits = ApiLimits(model_name="tiny", context=CONTEXT, timeout_s=timeout_s)
    return create_app(scheduler, tokenizer, limits, run_loop=True), scheduler


PROMPTS = ["w5 w6 w7", "w1 w2 w3 w4 w5 w6", "w9", "w40 w41 w42 w43", "w3 w30 w60 w90 w11"]


def sse(text: str) -> list[Any]:
    out = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_greedy_completions_equal_generate_and_stream(folder: Path) -> None:
    app, _ = make_app(folder)
    with TestClient(app) as client:
        assert client.get("/health").json()["status"] == "ok"
        assert client.get("/docs").status_code == 200
        assert "/v1/completions" in client.get("/openapi.json").json()["paths"]
        for prompt in PROMPTS:
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}
            got = client.post("/v1/completions", json=body).json()
            assert got["choices"][0]["text"] == expected_text(folder, prompt, 8), prompt
            assert got["usage"]["prompt_tokens"] == len(prompt.split())
        several = client.post(
            "/v1/completions", json={"prompt": PROMPTS[:3], "max_tokens": 6, "temperature": 0}
        ).json()
        texts = [c["text"] for c in sorted(several["choices"], key=lambda c: c["index"])]
        assert texts == [expected_text(folder, p, 6) for p in PROMPTS[:3]]
        body = {"prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0, "stream": True}
        events = sse(client.post("/v1/completions", json=body).text)
        assert events[-1] == "[DONE]"
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == expected_text(
            folder, PROMPTS[1], 8
        )
        assert events[-2]["choices"][0]["finish_reason"] in ("length", "stop")
        assert len(events) > 3  # streamed token by token
        # a stop string cuts the text before it
        full = expected_text(folder, PROMPTS[3], 8)
        cut = full.split()[2]
        body = {"prompt": PROMPTS[3], "max_tokens": 8, "temperature": 0, "stop": [cut]}
        choice = client.post("/v1/completions", json=body).json()["choices"][0]
        assert choice["text"] == full[: full.index(cut)] and choice["finish_reason"] == "stop"
        # sampling with a seed is reproducible
        body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 1.5, "top_k": 20,
                "top_p": 0.9, "seed": 7}  # fmt: skip
        first = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == first


BAD: list[tuple[Any, int, str]] = [
    ("{not json", 400, "JSON"),
    ({"prompt": "w1", "max_tokens": "many"}, 400, "max_tokens"),
    ({"prompt": 5}, 400, "prompt"),
    ({"max_tokens": 4}, 400, "prompt"),
    ({"prompt": "w1", "temperature": -1}, 400, "temperature"),
    ({"prompt": "w1", "top_p": 0}, 400, "top_p"),
    ({"prompt": "w1", "stream": "yes"}, 400, "stream"),
    ({"prompt": "w1 w2 w3", "max_tokens": CONTEXT}, 400, "context"),
    ({"prompt": "w1", "model": "gpt-4"}, 404, "gpt-4"),
    ({"prompt": [], "max_tokens": 2}, 400, "prompt"),
    ({"prompt": "", "max_tokens": 2}, 400, "empty"),
]


def post_bad(client: Any, body: Any) -> Any:
    if isinstance(body, str):
        return client.post(
            "/v1/completions", content=body, headers={"content-type": "application/json"}
        )
    return client.post("/v1/completions", json=body)


def test_validation_errors_are_4xx_with_a_message(folder: Path) -> None:
    app, _ = make_app(folder)
    with TestClient(app) as client:
        for body, status, words in BAD:
            response = post_bad(client, body)
            assert response.status_code == status, body
            message = response.json()["error"]["message"]
            assert words.lower() in message.lower(), (body, message)
        assert client.get("/nowhere").status_code == 404


def test_result_cache_serves_a_repeated_prompt(folder: Path) -> None:
    app, scheduler = make_app(folder, cache_size=4, cache_list_size=1)
    with TestClient(app) as client:
        body = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0}
        first = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        steps = scheduler.steps
        assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == first
        assert scheduler.steps == steps  # answered from the cache: no decoding step


def test_request_timeout_is_504_and_the_row_leaves(folder: Path) -> None:
    app, scheduler = make_app(folder, timeout_s=1e-4)
    with TestClient(app) as client:
        body = {"prompt": PROMPTS[0], "max_tokens": 20, "temperature": 0}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 504
        assert "timeout" in response.json()["error"]["message"]
        events = sse(client.post("/v1/completions", json={**body, "stream": True}).text)
        assert "did not finish" in events[-2]["error"]["message"] and events[-1] == "[DONE]"
        deadline = time.monotonic() + 60
        while scheduler.pending() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert scheduler.pending() == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def _load(base: str, folder: Path) -> None:
    expected = {p: expected_text(folder, p, 10) for p in PROMPTS}
    timeout = httpx.Timeout(120.0)
    async with httpx.AsyncClient(base_url=base, timeout=timeout) as client:

        async def valid(i: int) -> None:
            prompt = PROMPTS[i % len(PROMPTS)]
            body = {"prompt": prompt, "max_tokens": 10, "temperature": 0, "stream": True}
            text, done = "", False
            async with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        chunk = json.loads(line[6:])
                        assert "error" not in chunk, chunk
                        text += chunk["choices"][0]["text"]
            assert done and text == expected[prompt], (prompt, text)

        async def cancelled(i: int) -> None:
            body = {"prompt": PROMPTS[i % 5], "max_tokens": 20, "temperature": 0, "stream": True}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        break  # leave after the first token: the connection closes

        async def bad(i: int) -> None:
            body, status, _ = BAD[i % len(BAD)]
            kwargs: dict[str, Any] = {"json": body}
            if isinstance(body, str):
                kwargs = {"content": body, "headers": {"content-type": "application/json"}}
            response = await client.post("/v1/completions", **kwargs)
            assert response.status_code == status, body
            assert response.json()["error"]["message"]

        jobs = [valid(i) for i in range(12)] + [cancelled(i) for i in range(6)]
        jobs += [bad(i) for i in range(len(BAD))]
        results = await asyncio.gather(*jobs, return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        assert not failures, failures
        health = (await client.get("/health")).json()
        deadline = time.monotonic() + 60
        while health["pending"] and time.monotonic() < deadline:  # cancelled rows leave
            await asyncio.sleep(0.1)
            health = (await client.get("/health")).json()
        assert health == {"status": "ok", "model": "tiny", "pending": 0}


def test_load_on_loopback(folder: Path) -> None:
    app, _ = make_app(folder, executor_max_batch_size=4)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.05)
        asyncio.run(_load(f"http://127.0.0.1:{port}", folder))
    finally:
        server.should_exit = True
        thread.join(timeout=60)
    assert not thread.is_alive()


def test_cli_usage_errors_and_install_hint(
    folder: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from kolossos.cli import serve

    assert serve.main([str(folder / "missing")]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert serve.main([str(folder), "--timeout", "0"]) == 2
    assert "--timeout" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "fastapi", None)  # as if the serve extra were missing
    assert serve.main([str(folder)]) == 2
    assert "pip install 'kolossos[serve]'" in capsys.readouterr().err
