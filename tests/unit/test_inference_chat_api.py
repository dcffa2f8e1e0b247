"""``POST /v1/chat/completions`` on one process (FastAPI ``TestClient``) with the tiny GPT-2 and
word-level tokenizer of ``test_inference_serve_api.py``, given a chat template here.

The template maps each role to a marker word (system ``w1``, user ``w2``, assistant ``w3``) and
ends with the generation prompt ``w3``, so a conversation renders to a word prompt. Greedy chat
(``temperature: 0``) must equal transformers' ``generate`` on the rendered prompt; streaming
gives OpenAI's chunks (role, content deltas, the finish reason) with the same text. Without a
template, and for bad messages, the answer is a 400 naming the problem.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("tokenizers")
import transformers as tf
from fastapi.testclient import TestClient
from test_inference_serve_api import build_folder, expected_text, make_app, sse

TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}w1 {% elif m['role'] == 'user' %}w2 "
    "{% elif m['role'] == 'assistant' %}w3 {% else %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w3{% endif %}"
)

CHAT = [
    {"role": "system", "content": "w40 w41"},
    {"role": "user", "content": "w5 w6 w7"},
    {"role": "assistant", "content": "w8"},
    {"role": "user", "content": "w9 w10"},
]
RENDERED = "w1 w40 w41 w2 w5 w6 w7 w3 w8 w2 w9 w10 w3"


@pytest.fixture(scope="module")
def plain_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny GPT-2 folder; its tokenizer has no chat template."""
    path = tmp_path_factory.mktemp("tiny-plain")
    build_folder(path)
    return path


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny GPT-2 folder, its tokenizer given :data:`TEMPLATE`."""
    path = tmp_path_factory.mktemp("tiny-chat")
    build_folder(path)
    tokenizer = tf.AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    return path


def post(client: Any, body: dict[str, Any]) -> Any:
    return client.post("/v1/chat/completions", json=body)


def test_chat_greedy_equals_generate_and_streams(chat_folder: Path) -> None:
    tokenizer = tf.AutoTokenizer.from_pretrained(chat_folder)
    rendered = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert rendered.split() == RENDERED.split()
    want = expected_text(chat_folder, RENDERED, 8)
    assert want  # the model says something
    app, _ = make_app(chat_folder)
    with TestClient(app) as client:
        assert "/v1/chat/completions" in client.get("/openapi.json").json()["paths"]
        got = post(client, {"model": "tiny", "messages": CHAT, "max_tokens": 8, "temperature": 0})
        assert got.status_code == 200, got.text
        answer = got.json()
        assert answer["object"] == "chat.completion"
        assert answer["choices"][0]["message"] == {"role": "assistant", "content": want}
        assert answer["choices"][0]["finish_reason"] in ("length", "stop")
        assert answer["usage"]["prompt_tokens"] == len(RENDERED.split())
        # OpenAI's newer max_completion_tokens wins over max_tokens
        body = {"messages": CHAT, "max_tokens": 2, "max_completion_tokens": 8, "temperature": 0}
        assert post(client, body).json()["choices"][0]["message"]["content"] == want
        # the same through /v1/completions on the rendered prompt
        plain = {"prompt": RENDERED, "max_tokens": 8, "temperature": 0}
        assert client.post("/v1/completions", json=plain).json()["choices"][0]["text"] == want
        events = sse(post(client, {**body, "stream": True}).text)
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert deltas[0] == {"role": "assistant", "content": ""}
        assert deltas[-1] == {} and chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
        assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
        assert "".join(d.get("content", "") for d in deltas) == want
        assert len(deltas) > 4  # streamed piece by piece


def test_chat_errors_are_400_with_a_message(chat_folder: Path, plain_folder: Path) -> None:
    app, _ = make_app(chat_folder)
    with TestClient(app) as client:
        bad = [
            ({"messages": []}, "messages"),
            ({"messages": [{"role": "user"}]}, "content"),
            ({"messages": [{"role": "user", "content": 5}]}, "content"),
            ({"messages": [{"role": "robot", "content": "w5"}]}, "unknown role robot"),
            ({"messages": CHAT, "max_tokens": 30}, "over the model's context"),
            ({"messages": CHAT, "temperature": -1}, "temperature"),
        ]
        for body, words in bad:
            got = post(client, body)
            assert got.status_code == 400, (body, got.text)
            assert words in got.json()["error"]["message"], (body, got.json())
        other = post(client, {"messages": CHAT, "model": "other"})
        assert other.status_code == 404
    app, scheduler = make_app(plain_folder)  # a tokenizer without a chat template
    with TestClient(app) as client:
        got = post(client, {"messages": CHAT, "max_tokens": 4})
        assert got.status_code == 400
        message = got.json()["error"]["message"]
        assert "has no chat template" in message and "/v1/completions" in message
        assert scheduler.steps == 0
