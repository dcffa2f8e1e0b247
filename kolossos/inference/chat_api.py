"""OpenAI-compatible ``POST /v1/chat/completions`` for ``kolossos serve``.

The ``messages`` (``role`` and ``content`` strings) are rendered with the tokenizer's own chat
template (``apply_chat_template`` with the generation prompt added), tokenized without extra
special tokens, and generated like a completion: the same sampling fields, limits, cache and
batching. The answer is a ``chat.completion`` with one assistant message; with ``stream: true``
server-sent ``chat.completion.chunk`` events carry ``delta`` objects (the role first, then the
content piece by piece, then an empty delta with the ``finish_reason``) and ``data: [DONE]``.

A tokenizer without a chat template gets 400 naming the fix (``/v1/completions``, or a tokenizer
with one); so does a template that refuses the messages (its error message is passed on).

Importing this module needs the ``serve`` extra (``pip install 'kolossos[serve]'``).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from kolossos.inference.http_service import (
    ApiError,
    Generation,
    SamplingFields,
    TextStream,
    usage,
)

__all__ = ["ChatCompletionRequest", "ChatMessage", "add_chat_route"]


class ChatMessage(BaseModel):
    """One message of the conversation (text content only)."""

    model_config = ConfigDict(extra="ignore")

    role: StrictStr
    content: StrictStr


class ChatCompletionRequest(SamplingFields):
    """The body of ``POST /v1/chat/completions`` (OpenAI's fields; ``top_k`` is an extension;
    ``max_completion_tokens``, OpenAI's newer name, wins over ``max_tokens`` when given)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)


def _prompt_ids(generation: Generation, messages: list[ChatMessage]) -> tuple[int, ...]:
    tokenizer = generation.tokenizer
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(
            400,
            f"the tokenizer of {generation.limits.model_name!r} has no chat template, so "
            "/v1/chat/completions cannot build a prompt; use /v1/completions, or serve a "
            "tokenizer with one (chat_template.jinja, or chat_template in "
            "tokenizer_config.json)",
            "messages",
        )
    conversation = [{"role": m.role, "content": m.content} for m in messages]
    try:
        text = tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=False
        )
    except Exception as err:  # the template's own checks (e.g. roles must alternate)
        raise ApiError(400, f"the chat template refused the messages: {err}", "messages") from err
    return tuple(int(t) for t in tokenizer.encode(text, add_special_tokens=False))


def _chunk(cid: str, created: int, model: str, choice: dict[str, Any]) -> str:
    body = {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    return f"data: {json.dumps(body)}\n\n"


def add_chat_route(app: FastAPI, generation: Generation) -> None:
    """Register ``POST /v1/chat/completions`` on ``app``."""

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest) -> Any:
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        generation.check_model(body)
        if body.max_completion_tokens is not None:
            body = body.model_copy(update={"max_tokens": body.max_completion_tokens})
        ids = _prompt_ids(generation, body.messages)
        requests = generation.requests([ids], body, cid)
        streams = [TextStream(0, generation.tokenizer, body.stops())]
        name = generation.limits.model_name
        if body.stream:

            async def stream() -> AsyncIterator[str]:
                head = {"role": "assistant", "content": ""}
                yield _chunk(cid, created, name, _choice(head, None))
                try:
                    async for choice, delta in generation.events(requests, streams):
                        if delta:
                            yield _chunk(cid, created, name, _choice({"content": delta}, None))
                        if choice.finish_reason is not None:
                            yield _chunk(cid, created, name, _choice({}, choice.finish_reason))
                except ApiError as err:
                    yield f"data: {json.dumps({'error': {'message': err.message}})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream")
        text = ""
        async for _, delta in generation.events(requests, streams):
            text += delta
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "logprobs": None}
        choice["finish_reason"] = streams[0].finish_reason
        return {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": name,
            "choices": [choice],
            "usage": usage(requests, streams),
        }


def _choice(delta: dict[str, str], finish_reason: str | None) -> dict[str, Any]:
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
