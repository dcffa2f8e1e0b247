"""The serving loop: a FIFO request queue feeding a :class:`DecodingBatch`, on every rank of a
model replica (tensor-parallel ranks, pipeline stages, or both).

The replica's first rank (the *leader*, which also runs the HTTP server) owns the queue. Each
iteration it decides a :class:`StepPlan` — the requests that join, the cancelled ones, whether to
stop — and broadcasts it to the other ranks of the replica (``broadcast_object_list``, one small
collective per step); then every rank applies the plan and runs one decoding step. The ranks
therefore hold the same rows at every step, and the decoding step's token broadcast keeps their
tokens equal. Under pipeline parallelism every stage runs the same step on the same rows (its
forward calls exchange hidden states of the same shapes), and the last stage's tokens are
broadcast to all, the leader included. While idle the leader broadcasts an empty plan every
``idle_wait_s`` seconds, so the other ranks never wait long in a collective. A plan with ``stop``
ends the loop on every rank.

Admission: ``continuous`` admits queued requests in FIFO order whenever the batch has room;
``static`` waits for the batch to empty, then takes the queue's head plus the consecutive requests
with its sampling settings (:func:`bucket_key`) and at most its ``max_new_tokens``, up to
``executor_max_batch_size`` (Energon-AI's bucket batching).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace
from typing import Any

import torch.distributed as dist

from kolossos.inference.batching import (
    BatchingConfig,
    DecodingBatch,
    GenerationRequest,
    TokenEvent,
    bucket_key,
)
from kolossos.inference.engine import InferenceEngine
from kolossos.inference.result_cache import ResultCache
from kolossos.inference.sharding import hf_config

__all__ = ["Scheduler", "Sink", "StepPlan", "model_eos_and_pad"]

Sink = Callable[[TokenEvent | BaseException], None]
"""Receives a request's tokens (on the leader, from the loop's thread), or the error that ended
the loop."""


@dataclass(frozen=True)
class StepPlan:
    """What every rank does before the next decoding step."""

    join: list[GenerationRequest]
    cancel: list[str]
    stop: bool = False


def model_eos_and_pad(engine: InferenceEngine) -> tuple[tuple[int, ...], int]:
    """The model config's EOS ids and pad id (the first EOS, else 0, when it has no pad id)."""
    config = hf_config(engine.model)
    eos: Any = config.eos_token_id
    listed = eos if isinstance(eos, list | tuple) else [] if eos is None else [eos]
    eos_ids = tuple(int(e) for e in listed if e != -1)
    pad = config.pad_token_id
    return eos_ids, int(pad if pad is not None else eos_ids[0] if eos_ids else 0)


class Scheduler:
    """Queue, admission and the decoding loop of ``kolossos serve``.

    Every rank of the engine's replica builds one and calls :meth:`run` (the leader
    from a thread next to its HTTP server); only the leader's :meth:`submit`, :meth:`cancel` and
    :meth:`stop` are used.

    Args:
        engine: the engine (tensor-parallel, pipeline-parallel or both) whose model decodes.
        config: continuous or static batching, batch limit, result cache.
        idle_wait_s: how long the idle leader waits for a request before an empty plan.
    """

    def __init__(
        self, engine: InferenceEngine, config: BatchingConfig, *, idle_wait_s: float = 0.5
    ) -> None:
        self.engine = engine
        self.config = config
        self.eos_token_ids, pad = model_eos_and_pad(engine)
        self.batch = DecodingBatch(
            engine.decoder,
            cache_keyword=engine.cache_keyword,
            sync=engine.sync_tokens,
            pad_token_id=pad,
            keep_finished=config.mode == "static",
        )
        group = engine.tp_group
        self._src = None if group is None else dist.get_global_rank(group, 0)
        self.is_leader = group is None or dist.get_rank() == self._src
        self._idle_wait_s = idle_wait_s
        self._queue: deque[GenerationRequest] = deque()
        self._sinks: dict[str, Sink] = {}
        self._done: dict[str, list[TokenEvent]] = {}
        self._cancelled: set[str] = set()
        self._stopping = False
        self._admitted = 0  # taken from the queue, not yet in the batch
        self._cond = threading.Condition()
        self.cache: ResultCache[list[TokenEvent]] = ResultCache(
            config.cache_size, config.cache_list_size
        )
        self.steps = 0

    @staticmethod
    def _key(request: GenerationRequest) -> Hashable:
        return (request.prompt_ids, request.sampling, request.eos_token_ids)

    def submit(self, request: GenerationRequest, sink: Sink) -> None:
        """Queue ``request`` (FIFO); ``sink`` gets its tokens (a full cache entry: at once)."""
        cached = self.cache.get(self._key(request))
        if cached is not None:
            for event in cached:
                sink(replace(event, request_id=request.request_id))
            return
        with self._cond:
            if self._stopping:
                sink(RuntimeError("the server is shutting down"))
                return
            self._queue.append(request)
            self._sinks[request.request_id] = sink
            self._cond.notify()

    def cancel(self, request_id: str) -> None:
        """Forget a request (a client that left, a timeout); its row leaves at the next step."""
        with self._cond:
            self._sinks.pop(request_id, None)
            before = len(self._queue)
            self._queue = deque(r for r in self._queue if r.request_id != request_id)
            if len(self._queue) == before:
                self._cancelled.add(request_id)

    def stop(self) -> None:
        """End :meth:`run` on every rank after the current step (queued requests are dropped)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def pending(self) -> int:
        """Requests queued or decoding."""
        with self._cond:
            return len(self._queue) + self._admitted + self.batch.running

    def _admit(self) -> list[GenerationRequest]:
        room = self.config.executor_max_batch_size - self.batch.running
        if self.config.mode == "continuous":
            return [self._queue.popleft() for _ in range(min(room, len(self._queue)))]
        if self.batch.running or not self._queue:
            return []
        head = self._queue.popleft()
        bucket = [head]
        while (
            self._queue
            and len(bucket) < self.config.executor_max_batch_size
            and bucket_key(self._queue[0]) == bucket_key(head)
            and self._queue[0].sampling.max_new_tokens <= head.sampling.max_new_tokens
        ):
            bucket.append(self._queue.popleft())
        return bucket

    def _next_plan(self) -> StepPlan:
        with self._cond:
            if not (self._queue or self.batch.running or self._cancelled or self._stopping):
                self._cond.wait(self._idle_wait_s)
            running = set(self.batch.request_ids)
            cancel = sorted(self._cancelled & running)
            self._cancelled.clear()
            if self._stopping:
                return StepPlan([], cancel, stop=True)
            join = self._admit()
            self._admitted = len(join)
            return StepPlan(join, cancel)

    def _broadcast(self, plan: StepPlan | None) -> StepPlan:
        if self._src is None:
            assert plan is not None
            return plan
        box: list[Any] = [plan]
        dist.broadcast_object_list(box, src=self._src, group=self.engine.tp_group)
        received: StepPlan = box[0]
        return received

    def _deliver(self, events: list[TokenEvent]) -> None:
        for event in events:
            with self._cond:
                if event.finish_reason is None:
                    sink = self._sinks.get(event.request_id)
                else:
                    sink = self._sinks.pop(event.request_id, None)
            if sink is not None:
                sink(event)

    def _remember(self, events: list[TokenEvent], joined: dict[str, GenerationRequest]) -> None:
        for event in events:
            if event.finish_reason is None:
                continue
            request = joined.pop(event.request_id, None)
            done = self._done.pop(event.request_id, [])
            if request is not None:
                self.cache.add(self._key(request), [*done, event])

    def run(self) -> None:
        """Decode until :meth:`stop` (on the leader) or a stop plan (on the others)."""
        joined: dict[str, GenerationRequest] = {}
        try:
            while True:
                plan = self._broadcast(self._next_plan() if self.is_leader else None)
                self.batch.cancel(set(plan.cancel))
                for request_id in plan.cancel:
                    joined.pop(request_id, None)
                    self._done.pop(request_id, None)
                if plan.stop:
                    return
                with self._cond:
                    self.batch.add(plan.join)
                    self._admitted = 0
                joined.update((r.request_id, r) for r in plan.join)
                events = self.batch.step()
                self.steps += bool(events)
                if self.is_leader:
                    for event in events:
                        if event.finish_reason is None:
                            self._done.setdefault(event.request_id, []).append(event)
                    self._remember(events, joined)
                    self._deliver(events)
        except BaseException as error:
            with self._cond:
                sinks, self._sinks = list(self._sinks.values()), {}
                self._stopping = True
            for sink in sinks:
                sink(error)
            raise
