"""What ``/v1/completions`` and ``/v1/chat/completions`` share: the sampling fields of a request,
its validation into :class:`GenerationRequest` rows, and the stream of text deltas the
scheduler's tokens become (with ``stop`` strings, the per-request timeout and cancellation).

Importing this module needs the ``serve`` extra (``pip install 'kolossos[serve]'``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from kolossos.inference.batching import GenerationRequest, TokenEvent
from kolossos.inference.sampling import SamplingConfig
from kolossos.inference.scheduler import Scheduler

__all__ = [
    "ApiError",
    "ApiLimits",
    "Generation",
    "SamplingFields",
    "TextStream",
    "error_response",
    "usage",
]


class SamplingFields(BaseModel):
    """The OpenAI fields both endpoints take (``top_k`` is an extension)."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    max_tokens: StrictInt = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=0)
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    stream: StrictBool = False

    def sampling(self) -> SamplingConfig:
        """The request's sampling settings (``temperature: 0`` is greedy)."""
        return SamplingConfig(
            max_new_tokens=self.max_tokens,
            do_sample=self.temperature > 0,
            temperature=self.temperature if self.temperature > 0 else 1.0,
            top_k=self.top_k or None,
            top_p=self.top_p,
            seed=self.seed,
        )

    def stops(self) -> list[str]:
        """The non-empty ``stop`` strings."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stops if s]


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


class ApiError(Exception):
    """A request the service refuses: HTTP ``status``, a message, the offending field."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    """An OpenAI-style error body ``{"error": {"message", "type", "param", "code"}}``."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return JSONResponse(body, status_code=status)


@dataclass
class TextStream:
    """Turns one request's tokens into text deltas, applying the ``stop`` strings."""

    index: int
    tokenizer: Any
    stops: list[str]
    ids: list[int] = field(default_factory=list)
    sent: int = 0
    finish_reason: str | None = None

    def feed(self, event: TokenEvent) -> str:
        """Take the next token; the text that may be sent now (possibly empty)."""
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


class Generation:
    """Validates requests into scheduler rows and streams their text back.

    Args:
        scheduler: the leader rank's scheduler.
        tokenizer: a transformers tokenizer (``encode`` / ``decode``).
        limits: model name, context, timeout, prompt-list limit.
    """

    def __init__(self, scheduler: Scheduler, tokenizer: Any, limits: ApiLimits) -> None:
        self.scheduler, self.tokenizer, self.limits = scheduler, tokenizer, limits

    def check_model(self, body: SamplingFields) -> None:
        """404 unless ``model`` is absent or the served name."""
        name = self.limits.model_name
        if body.model is not None and body.model != name:
            raise ApiError(404, f"model {body.model!r} is not served here; use {name!r}", "model")

    def requests(
        self, prompts: list[tuple[int, ...]], body: SamplingFields, cid: str
    ) -> list[GenerationRequest]:
        """One row per tokenized prompt, checked against the context."""
        sampling = body.sampling()
        out = []
        for i, ids in enumerate(prompts):
            if not ids:
                raise ApiError(400, f"prompt {i} is empty after tokenization", "prompt")
            if len(ids) + body.max_tokens > self.limits.context:
                raise ApiError(
                    400,
                    f"prompt {i} has {len(ids)} tokens; with max_tokens={body.max_tokens} that "
                    f"is over the model's context of {self.limits.context} tokens: shorten the "
                    "prompt or lower max_tokens",
                    "max_tokens",
                )
            out.append(
                GenerationRequest(
                    request_id=f"{cid}-{i}",
                    prompt_ids=ids,
                    sampling=sampling,
                    eos_token_ids=self.scheduler.eos_token_ids,
                )
            )
        return out

    def _submit(self, requests: list[GenerationRequest]) -> asyncio.Queue[Any]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Any] = asyncio.Queue()
        for index, request in enumerate(requests):

            def sink(event: TokenEvent | BaseException, index: int = index) -> None:
                with contextlib.suppress(RuntimeError):  # a closed loop: nobody listens
                    loop.call_soon_threadsafe(queue.put_nowait, (index, event))

            self.scheduler.submit(request, sink)
        return queue

    async def events(
        self, requests: list[GenerationRequest], streams: list[TextStream]
    ) -> AsyncIterator[tuple[TextStream, str]]:
        """Submit ``requests`` and yield ``(stream, text delta)`` as tokens arrive, until every
        stream has its finish reason; rows still open when this ends are cancelled.

        Raises:
            ApiError: 504 after the timeout, 500 if the decoding loop failed.
        """
        deadline = time.monotonic() + self.limits.timeout_s
        queue = self._submit(requests)
        open_ = set(range(len(requests)))
        try:
            while open_:
                left = deadline - time.monotonic()
                try:
                    index, event = await asyncio.wait_for(queue.get(), max(left, 0.0))
                except asyncio.TimeoutError:  # TimeoutError from Python 3.11 on
                    raise ApiError(
                        504, f"generation did not finish within {self.limits.timeout_s:g} s "
                        "(kolossos serve --timeout)",
                    ) from None  # fmt: skip
                if isinstance(event, BaseException):
                    raise ApiError(500, f"the decoding loop failed: {event!r}")
                if index not in open_:
                    continue
                stream = streams[index]
                delta = stream.feed(event)
                if stream.finish_reason is not None:
                    open_.discard(index)
                    if event.finish_reason is None:  # a stop string ended it early
                        self.scheduler.cancel(requests[index].request_id)
                yield stream, delta
        finally:
            for index in open_:
                self.scheduler.cancel(requests[index].request_id)


def usage(requests: list[GenerationRequest], streams: list[TextStream]) -> dict[str, int]:
    """OpenAI's ``usage`` block."""
    completion = sum(len(s.ids) for s in streams)
    prompt = sum(len(r.prompt_ids) for r in requests)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
