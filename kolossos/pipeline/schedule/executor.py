"""One executor for every schedule: runs this rank's row of a :class:`ScheduleTable`.

For each action: ``F`` takes its input (the micro-batch on the first stage, else the previous
stage's activation), runs the chunk and hands the output on (the loss, on the last stage, is
computed only there); ``B`` takes the output gradient and back-propagates through the chunk
(only to the input when the table splits the backward) and hands the input gradient back;
``W`` finishes a split backward. Hand-offs between chunks of the same rank (the turn of the V
layout) skip the network; the others go through :class:`~kolossos.pipeline.p2p.PipelineP2P`.
Forward-only (evaluation, run under ``torch.no_grad()``) executes only the ``F`` actions, in the
table's order, keeps no activations after each forward and exchanges activations on streams of
their own (their cached metadata says no gradient is wanted, which must not leak into training).
The executor counts the micro-batches whose activations are alive (from ``F`` to the last
backward part) and times each action and its waits.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from kolossos.pipeline.p2p import PipelineP2P, TensorSpec, spec_of
from kolossos.pipeline.schedule.microbatch import detach_all, first_stage_call, loss_target
from kolossos.pipeline.schedule.split_backward import (
    WeightGradWork,
    backward_input,
    backward_weight,
)
from kolossos.pipeline.schedule.table import Action, ActionKind, Message, ScheduleTable

Payload = tuple[list[torch.Tensor], bool]


@dataclass
class StepStats:
    """What one step of the executor measured on this rank."""

    peak_live: int = 0
    """most micro-batch activations alive at once (all chunks)"""
    peak_live_per_chunk: list[int] = field(default_factory=list)
    wall_s: float = 0.0
    compute_s: float = 0.0
    """time inside actions, waits excluded"""
    wait_s: float = 0.0
    """time blocked on receives"""
    split_fallbacks: int = 0
    """split backwards that ran whole in ``B`` (a weight used at two depths of one chunk)"""
    timeline: list[tuple[str, float, float, float]] = field(default_factory=list)
    """``(action, start, end, wait)`` in seconds from the step's start"""

    @property
    def idle_fraction(self) -> float:
        """Share of the step this rank did not compute."""
        return 1.0 - self.compute_s / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class _State:
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    loss: torch.Tensor | None = None
    work: WeightGradWork | None = None


class ScheduleExecutor:
    """Runs one rank's actions of ``table`` for one step.

    Args:
        table: the schedule.
        position: this rank's pipeline position.
        global_rank: maps a pipeline position to its global rank.
        p2p: the point-to-point layer (kept across steps: it caches shapes).
        chunks: this rank's model chunks, by chunk index.
        criterion: ``criterion(output, target) -> loss`` (last stage only).
        optimizer: routes the unsplit backward through ``optimizer.backward`` /
            ``backward_by_grad`` when it has them (mixed precision, ZeRO).
        microbatches: the step's micro-batches (read by the first and the last stage).
        forward_only: run only the forward actions (call it under ``torch.no_grad()``).
    """

    def __init__(
        self,
        table: ScheduleTable,
        position: int,
        global_rank: Callable[[int], int],
        p2p: PipelineP2P,
        chunks: Sequence[nn.Module],
        criterion: Callable[..., torch.Tensor],
        optimizer: Any,
        microbatches: list[Any],
        forward_only: bool = False,
    ) -> None:
        self.t, self.pos, self.global_rank, self.p2p = table, position, global_rank, p2p
        self.chunks, self.criterion, self.optimizer = chunks, criterion, optimizer
        self.mbs = microbatches
        self.forward_only = forward_only
        self._stream = "act-fwd" if forward_only else "act"
        self.queues = {
            src: deque(
                m for m in table.messages(src, position) if m.kind == "act" or not forward_only
            )
            for src in range(table.pp_size)
            if src != position
        }
        self.buffer: dict[Message, Any] = {}
        self.states: dict[tuple[int, int], _State] = {}
        self.losses: list[torch.Tensor] = []
        self.outputs: dict[int, Any] = {}
        self.stats = StepStats(peak_live_per_chunk=[0] * table.num_chunks)
        self._live = [0] * table.num_chunks
        self._params: list[list[torch.Tensor]] = [
            [p for p in c.parameters() if p.requires_grad] for c in chunks
        ]

    def run(self, keep_outputs: bool) -> StepStats:
        """Execute every action of this rank, then wait for the sends to complete."""
        self.keep_outputs = keep_outputs
        start = time.perf_counter()
        for action in self.t.ranks[self.pos]:
            if self.forward_only and action.kind is not ActionKind.F:
                continue
            a_start, wait_before = time.perf_counter(), self.stats.wait_s
            {ActionKind.F: self._forward, ActionKind.B: self._backward,
             ActionKind.W: self._weight}[action.kind](action)  # fmt: skip
            end, waited = time.perf_counter(), self.stats.wait_s - wait_before
            self.stats.compute_s += end - a_start - waited
            self.stats.timeline.append((str(action), a_start - start, end - start, waited))
        wait = time.perf_counter()
        self.p2p.wait_sends()  # SYNC POINT: our messages are out before the buffers go
        self.stats.wait_s += time.perf_counter() - wait
        self.stats.wall_s = time.perf_counter() - start
        assert not self.states and not self.buffer, "schedule left work undone"
        return self.stats

    # --- messages -----------------------------------------------------------------------------
    def _sender(self, msg: Message) -> int:
        return self.t.owner_of(msg.stage - 1 if msg.kind == "act" else msg.stage + 1)[0]

    def _take(self, msg: Message) -> Any:
        """The payload of ``msg``, receiving (in the sender's order) what comes before it."""
        src = self._sender(msg)
        if src != self.pos:
            started = time.perf_counter()
            while msg not in self.buffer:
                nxt = self.queues[src].popleft()
                self.buffer[nxt] = self._receive(src, nxt)
            self.stats.wait_s += time.perf_counter() - started
        return self.buffer.pop(msg)

    def _receive(self, src: int, msg: Message) -> Any:
        if msg.kind == "act":
            return self.p2p.recv_activation(self.global_rank(src), (self._stream, msg.stage))
        chunk = self.t.owner_of(msg.stage)[1]
        outs = self.states[(chunk, msg.microbatch)].outputs
        specs = [spec_of(o) for o in outs if o.requires_grad]
        specs = [TensorSpec(s.shape, s.dtype, False) for s in specs]
        return self.p2p.recv_grad(self.global_rank(src), specs)

    def _hand_on(self, msg: Message, payload: Any) -> None:
        dst = self.t.owner_of(msg.stage)[0]
        if dst == self.pos:  # same rank (V turn): cut the graph as a send would
            if msg.kind == "act":
                tensors, is_tuple = payload
                cut = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
                self.buffer[msg] = (cut, is_tuple)
            else:
                self.buffer[msg] = [g.detach() for g in payload]
        elif msg.kind == "act":
            self.p2p.send_activation(self.global_rank(dst), (self._stream, msg.stage), *payload)
        else:
            self.p2p.send_grad(self.global_rank(dst), payload)

    # --- actions ------------------------------------------------------------------------------
    def _forward(self, action: Action) -> None:
        c, i = action.chunk, action.microbatch
        stage = self.t.stage_of(self.pos, c)
        if stage == 0:
            args, kwargs = first_stage_call(self.mbs[i])
            inputs = [a for a in args if isinstance(a, torch.Tensor)]
        else:
            inputs, is_tuple = self._take(Message("act", stage, i))
            args, kwargs = (tuple(inputs) if is_tuple or len(inputs) > 1 else (inputs[0],)), {}
        out = self.chunks[c](*args, **kwargs)
        if stage == self.t.num_stages - 1:
            loss = self.criterion(out, loss_target(self.mbs[i])) / self.t.num_microbatches
            self.losses.append(loss.detach())
            if self.keep_outputs:
                self.outputs[i] = detach_all(out)
            self.states[(c, i)] = _State(inputs, [], loss)
        else:
            outs, is_tuple = _as_tensors(out, stage)
            self._hand_on(Message("act", stage + 1, i), (outs, is_tuple))
            self.states[(c, i)] = _State(inputs, outs)
        self._count(c, +1)
        if self.forward_only:  # nothing to go back through: the activations go at once
            self._release(c, i)

    def _backward(self, action: Action) -> None:
        c, i = action.chunk, action.microbatch
        stage, state = self.t.stage_of(self.pos, c), self.states[(c, action.microbatch)]
        outs: list[torch.Tensor]
        grads: list[torch.Tensor | None]
        if state.loss is not None:
            outs, grads = [state.loss], [None]
        else:
            outs = [o for o in state.outputs if o.requires_grad]
            grads = self._take(Message("grad", stage, i))
        if self.t.split_backward:
            in_grads, state.work = backward_input(outs, grads, state.inputs, self._params[c])
            self.stats.split_fallbacks += int(not state.work.split)
        else:
            in_grads = self._full_backward(outs, grads, state)
        if stage > 0:
            sent = [
                g if g is not None else torch.zeros_like(t)
                for t, g in zip(state.inputs, in_grads, strict=True)
                if t.requires_grad
            ]
            self._hand_on(Message("grad", stage - 1, i), sent)
        if not self.t.split_backward:
            self._release(c, i)

    def _full_backward(
        self, outs: list[torch.Tensor], grads: list[Any], state: _State
    ) -> list[torch.Tensor | None]:
        for t in state.inputs:
            t.grad = None
        if state.loss is not None and hasattr(self.optimizer, "backward"):
            self.optimizer.backward(state.loss)
        elif state.loss is not None:
            state.loss.backward()
        elif outs and hasattr(self.optimizer, "backward_by_grad"):
            self.optimizer.backward_by_grad(outs, grads)
        elif outs:
            torch.autograd.backward(outs, grads)
        return [t.grad if t.requires_grad else None for t in state.inputs]

    def _weight(self, action: Action) -> None:
        state = self.states[(action.chunk, action.microbatch)]
        assert state.work is not None, f"{action} before its B"
        backward_weight(state.work)
        self._release(action.chunk, action.microbatch)

    def _release(self, chunk: int, microbatch: int) -> None:
        del self.states[(chunk, microbatch)]
        self._count(chunk, -1)

    def _count(self, chunk: int, delta: int) -> None:
        self._live[chunk] += delta
        per = self.stats.peak_live_per_chunk
        per[chunk] = max(per[chunk], self._live[chunk])
        self.stats.peak_live = max(self.stats.peak_live, sum(self._live))


def _as_tensors(out: Any, stage: int) -> tuple[list[torch.Tensor], bool]:
    if isinstance(out, torch.Tensor):
        return [out], False
    if isinstance(out, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in out):
        return list(out), True
    raise TypeError(
        f"stage {stage} returned a {type(out).__name__}; a stage that is not the last must return "
        "a tensor or a tuple of tensors (they are sent to the next stage)."
    )
