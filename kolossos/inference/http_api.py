"""The HTTP API of ``kolossos serve``: OpenAI-compatible ``POST /v1/completions`` on FastAPI.

Endpoints: ``POST /v1/completions`` (``prompt`` a string or a list of strings, ``max_tokens``,
``temperature`` — 0 is greedy —, ``top_p``, ``top_k`` (an extension), ``stop``, ``seed``,
``stream`` as server-sent events ending with ``data: [DONE]``), ``POST /v1/chat/completions``
(:mod:`kolossos.inference.chat_api`), ``GET /v1/models``, ``GET /health``, and FastAPI's OpenAPI
page at ``/docs``.

Every invalid request gets a 4xx with an OpenAI-style body ``{"error": {"message", "type",
"param"}}``: 400 for bad JSON, wrong types, out-of-range values and prompts too long for the
context, 404 for another model's name, 504 when generation outlives the per-request timeout.
A streaming client that disconnects cancels its requests (their rows leave the batch).

Importing this module needs the ``serve`` extra (``pip install 'kolossos[serve]'``).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import StrictStr
from starlette.exceptions import HTTPException as StarletteHTTPException

from kolossos.inference.chat_api import add_chat_route
from kolossos.inference.http_service import (
    ApiError,
    ApiLimits,
    Generation,
    SamplingFields,
    TextStream,
    error_response,
    usage,
)
from kolossos.inference.scheduler import Scheduler

__all__ = ["ApiLimits", "CompletionRequest", "create_app"]


class CompletionRequest(SamplingFields):
    """The body of ``POST /v1/completions`` (OpenAI's fields; ``top_k`` is an extension)."""

    prompt: StrictStr | list[StrictStr]


def _chunk(cid: str, created: int, model: str, choice: dict[str, Any]) -> str:
    body = {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    return f"data: {json.dumps(body)}\n\n"


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            problems.append(f"{where or 'body'}: {err.get('msg')}")
        first = exc.errors()[0].get("loc", ()) if exc.errors() else ()
        param = ".".join(str(p) for p in first if p != "body") or None
        return error_response(400, "invalid request: " + "; ".join(problems), param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param)


def create_app(scheduler: Scheduler, tokenizer: Any, limits: ApiLimits, *, run_loop: bool) -> Any:
    """The FastAPI application serving ``scheduler``'s model.

    Args:
        scheduler: the leader rank's scheduler.
        tokenizer: a transformers tokenizer (``encode`` / ``decode``; ``apply_chat_template``
            and a ``chat_template`` for ``/v1/chat/completions``).
        limits: model name, context, timeout, prompt-list limit.
        run_loop: start :meth:`Scheduler.run` in a thread for the app's lifetime (stopped on
            shutdown); ``False`` when the caller runs it.
    """

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        thread = threading.Thread(target=scheduler.run, name="kolossos-serve-loop", daemon=True)
        if run_loop:
            thread.start()
        app.state.loop_thread = thread if run_loop else None
        try:
            yield
        finally:
            if run_loop:
                scheduler.stop()
                thread.join(timeout=60)

    app = FastAPI(title="kolossos serve", version="1", lifespan=lifespan)
    _add_error_handlers(app)
    generation = Generation(scheduler, tokenizer, limits)

    @app.get("/health")
    async def health() -> JSONResponse:
        thread = app.state.loop_thread
        alive = thread is None or thread.is_alive()
        body: dict[str, Any] = {"status": "ok" if alive else "failed"}
        body.update(model=limits.model_name, pending=scheduler.pending())
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": limits.model_name, "object": "model", "owned_by": "kolossos"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Any:
        cid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        generation.check_model(body)
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if not 1 <= len(prompts) <= limits.max_prompts:
            raise ApiError(
                400, f"prompt must hold 1 to {limits.max_prompts} strings, got {len(prompts)}",
                "prompt",
            )  # fmt: skip
        ids = [tuple(int(t) for t in tokenizer.encode(p)) for p in prompts]
        requests = generation.requests(ids, body, cid)
        streams = [TextStream(i, tokenizer, body.stops()) for i in range(len(requests))]
        name = limits.model_name
        if body.stream:

            async def stream() -> AsyncIterator[str]:
                try:
                    async for choice, delta in generation.events(requests, streams):
                        if delta or choice.finish_reason is not None:
                            piece = {"text": delta, "index": choice.index, "logprobs": None}
                            piece["finish_reason"] = choice.finish_reason
                            yield _chunk(cid, created, name, piece)
                except ApiError as err:
                    yield f"data: {json.dumps({'error': {'message': err.message}})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream")
        texts = [""] * len(requests)
        async for choice, delta in generation.events(requests, streams):
            texts[choice.index] += delta
        return {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": name,
            "choices": [
                {"text": t, "index": c.index, "logprobs": None, "finish_reason": c.finish_reason}
                for t, c in zip(texts, streams, strict=True)
            ],
            "usage": usage(requests, streams),
        }

    add_chat_route(app, generation)
    return app
