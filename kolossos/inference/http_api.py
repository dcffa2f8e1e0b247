"""The HTTP API of ``kolossos serve``: OpenAI-compatible ``POST /v1/completions`` on FastAPI.

Endpoints: ``POST /v1/completions`` (``prompt`` a string or a list of strings, ``max_tokens``,
``temperature`` — 0 is greedy —, ``top_p``, ``top_k`` (an extension), ``stop``, ``seed``,
``stream`` as server-sent events ending with ``data: [DONE]``), ``GET /v1/models``,
``GET /health``, and FastAPI's OpenAPI page at ``/docs``.

Every invalid request gets a 4xx with an OpenAI-style body ``{"error": {"message", "type",
"param"}}``: 400 for bad JSON, wrong types, out-of-range values and prompts too long for the
context, 404 for another model's name, 504 when generation outlives the per-request timeout.
A streaming client that disconnects cancels its requests (their rows leave the batch).

Importing this module needs the ``serve`` extra (``pip install 'kolossos[serve]'``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr
from starlette.exceptions import HTTPException as StarletteHTTPException

from kolossos.inference.batching import GenerationRequest, TokenEvent
from kolossos.inference.sampling import SamplingConfig
from kolossos.inference.scheduler import Scheduler

__all__ = ["ApiLimits", "CompletionRequest", "create_app"]


class CompletionRequest(BaseModel):
    """The body of ``POST /v1/completions`` (OpenAI's fields; ``top_k`` is an extension)."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    prompt: StrictStr | list[StrictStr]
    max_tokens: StrictInt = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=0)
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    stream: StrictBool = False


@dataclass(frozen=True, kw_only=True)
class ApiLimits:
    """Request limits of the service."""

    model_name: str
    """The name clients pass as ``model`` (any other name is a 404)."""
    context: int
    """The model's positions: prompt tokens plus ``max_tokens`` must fit."""
    timeout_s: float = 60.0
    """A request still generating after this long ends with 504 (or an error event)."""
    max_prompts: int = 16
    """The most prompts in one request's list."""


class _ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status)


@dataclass
class _Choice:
    """Turns one request's tokens into text, applying the ``stop`` strings."""

    index: int
    tokenizer: Any
    stops: list[str]
    ids: list[int] = field(default_factory=list)
    sent: int = 0
    finish_reason: str | None = None

    def feed(self, event: TokenEvent) -> str:
        if event.finish_reason != "stop":  # an EOS token is not part of the text
            self.ids.append(event.token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        self.finish_reason = event.finish_reason
        hits = [text.find(s) for s in self.stops if s in text]
        if hits:
            text, self.finish_reason = text[: min(hits)], "stop"
        end = len(text)
        if self.finish_reason is None:  # hold back what may start a stop string or a character
            end -= max((len(s) - 1 for s in self.stops), default=0)
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
        delta, self.sent = text[self.sent : max(end, self.sent)], max(end, self.sent)
        return delta


def _chunk(cid: str, created: int, model: str, choice: dict[str, Any]) -> str:
    body = {
        "id": cid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    return f"data: {json.dumps(body)}\n\n"


def create_app(scheduler: Scheduler, tokenizer: Any, limits: ApiLimits, *, run_loop: bool) -> Any:
    """The FastAPI application serving ``scheduler``'s model.

    Args:
        scheduler: the leader rank's scheduler.
        tokenizer: a transformers tokenizer (``encode`` / ``decode``).
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

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            problems.append(f"{where or 'body'}: {err.get('msg')}")
        first = exc.errors()[0].get("loc", ()) if exc.errors() else ()
        param = ".".join(str(p) for p in first if p != "body") or None
        return _error(400, "invalid request: " + "; ".join(problems), param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(_ApiError)
    async def api_error(_: Request, exc: _ApiError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.param)

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

    def _requests(body: CompletionRequest, cid: str) -> list[GenerationRequest]:
        if body.model is not None and body.model != limits.model_name:
            raise _ApiError(
                404, f"model {body.model!r} is not served here; use {limits.model_name!r}", "model"
            )
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if not 1 <= len(prompts) <= limits.max_prompts:
            raise _ApiError(
                400, f"prompt must hold 1 to {limits.max_prompts} strings, got {len(prompts)}",
                "prompt",
            )  # fmt: skip
        sampling = SamplingConfig(
            max_new_tokens=body.max_tokens,
            do_sample=body.temperature > 0,
            temperature=body.temperature if body.temperature > 0 else 1.0,
            top_k=body.top_k or None,
            top_p=body.top_p,
            seed=body.seed,
        )
        out = []
        for i, prompt in enumerate(prompts):
            ids = tuple(int(t) for t in tokenizer.encode(prompt))
            if not ids:
                raise _ApiError(400, f"prompt {i} is empty after tokenization", "prompt")
            if len(ids) + body.max_tokens > limits.context:
                raise _ApiError(
                    400,
                    f"prompt {i} has {len(ids)} tokens; with max_tokens={body.max_tokens} that "
                    f"is over the model's context of {limits.context} tokens: shorten the "
                    "prompt or lower max_tokens",
                    "max_tokens",
                )
            out.append(
                GenerationRequest(
                    request_id=f"{cid}-{i}",
                    prompt_ids=ids,
                    sampling=sampling,
                    eos_token_ids=scheduler.eos_token_ids,
                )
            )
        return out

    def _submit(requests: list[GenerationRequest]) -> asyncio.Queue[Any]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        for index, request in enumerate(requests):

            def sink(event: TokenEvent | BaseException, index: int = index) -> None:
                with contextlib.suppress(RuntimeError):  # a closed loop: nobody listens
                    loop.call_soon_threadsafe(queue.put_nowait, (index, event))

            scheduler.submit(request, sink)
        return queue

    async def _events(
        requests: list[GenerationRequest], choices: list[_Choice], deadline: float
    ) -> AsyncIterator[tuple[_Choice, str]]:
        queue = _submit(requests)
        open_ = set(range(len(requests)))
        try:
            while open_:
                left = deadline - time.monotonic()
                try:
                    index, event = await asyncio.wait_for(queue.get(), max(left, 0.0))
                except asyncio.TimeoutError:  # TimeoutError from Python 3.11 on
                    raise _ApiError(
                        504, f"generation did not finish within {limits.timeout_s:g} s "
                        "(kolossos serve --timeout)",
                    ) from None  # fmt: skip
                if isinstance(event, BaseException):
                    raise _ApiError(500, f"the decoding loop failed: {event!r}")
                if index not in open_:
                    continue
                choice = choices[index]
                delta = choice.feed(event)
                if choice.finish_reason is not None:
                    open_.discard(index)
                    if event.finish_reason is None:  # a stop string ended it early
                        scheduler.cancel(requests[index].request_id)
                yield choice, delta
        finally:
            for index in open_:
                scheduler.cancel(requests[index].request_id)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Any:
        cid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        requests = _requests(body, cid)
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        stops = [s for s in stops if s]
        choices = [_Choice(i, tokenizer, stops) for i in range(len(requests))]
        deadline = time.monotonic() + limits.timeout_s
        name = limits.model_name
        if body.stream:

            async def stream() -> AsyncIterator[str]:
                try:
                    async for choice, delta in _events(requests, choices, deadline):
                        if delta or choice.finish_reason is not None:
                            piece = {"text": delta, "index": choice.index, "logprobs": None}
                            piece["finish_reason"] = choice.finish_reason
                            yield _chunk(cid, created, name, piece)
                except _ApiError as err:
                    yield f"data: {json.dumps({'error': {'message': err.message}})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream")
        texts = [""] * len(requests)
        async for choice, delta in _events(requests, choices, deadline):
            texts[choice.index] += delta
        completion_tokens = sum(len(c.ids) for c in choices)
        prompt_tokens = sum(len(r.prompt_ids) for r in requests)
        return {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": name,
            "choices": [
                {"text": t, "index": c.index, "logprobs": None, "finish_reason": c.finish_reason}
                for t, c in zip(texts, choices, strict=True)
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    return app
