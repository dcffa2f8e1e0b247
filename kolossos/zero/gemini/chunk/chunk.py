"""``Chunk``: several parameters in one contiguous payload, sharded over the data-parallel ranks.

Storage of one chunk of ``chunk_size`` elements (a multiple of the world size ``N``) on a rank:

* ``master`` — this rank's fp32 slice (``chunk_size / N`` elements): the source of truth,
  stepped by the optimizer, on the optimizer's device (``optim_device``);
* ``shard`` — the same slice in the working dtype, on ``device_type``: a cache of ``master`` made
  when the chunk is gathered and dropped again once its gradient is reduced (a kept-gathered
  chunk's shard is instead a view of its payload);
* ``payload`` — the full chunk in the working dtype on the compute device while gathered; the
  parameters' ``.data`` are views of it then, and empty placeholders otherwise;
* ``grad_payload`` — the full gradient in the working dtype during backward, reduce-scattered
  into ``grad_shard`` (beside ``master``), where gradients accumulate until the optimizer steps
  (or ``zero_grad``). It is fp32, or stays in the working dtype when ``grad_dtype`` says so (bf16
  with an optimizer that widens gradients itself, :class:`GeminiOptimizer`): the reduced part is
  in that dtype anyway, so nothing is lost, and a second backward before the step widens the
  shard to fp32 before adding, so accumulation is as exact as before.

A sharded chunk whose tensors are all trainable writes its gradients over its own gathered
payload (``grad_payload`` is ``payload``): a parameter's value is not read again in a backward
once its gradient has arrived (autograd accumulates every use of it first), the master keeps the
true value, and the chunk is released right after its reduction. That saves a chunk-sized buffer
per backward and the page faults of touching a fresh one. Kept-gathered chunks (their payload
outlives the step) and chunks with frozen tensors (whose values a later backward op may still
read) write into a buffer of their own.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from kolossos.zero.gemini.chunk.comm import ChunkComm, Pending
from kolossos.zero.gemini.chunk.state import TensorState, check_transition
from kolossos.zero.gemini.memory_tracer.scope import model_data_scope

__all__ = ["Chunk", "ChunkFullError", "TensorInfo", "TensorState", "all_gather_flat"]

# torch 2.13 renamed the flat collectives (the old names warn); 2.11 only has the old names
all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ChunkFullError(Exception):
    """A tensor was appended to a chunk without room for it."""


@dataclass
class TensorInfo:
    """Where one parameter lives in its chunk, and its state."""

    param: nn.Parameter
    name: str
    offset: int
    numel: int
    shape: torch.Size
    state: TensorState = TensorState.FREE
    has_grad: bool = False
    """A gradient reached it since the gradient shard was last dropped (step, ``zero_grad``)."""


class Chunk:
    """One chunk; built by :class:`~kolossos.zero.gemini.chunk.manager.ChunkManager`.

    Args:
        chunk_id: position in the manager's list.
        chunk_size: capacity in elements (a multiple of the world size).
        dtype: the working (compute) dtype.
        group: the data-parallel process group.
        compute_device: where the payload lives while gathered.
        keep_gathered: keep the full payload at all times (only gradients and optimizer states
            are sharded, like ZeRO-2).
        comm: the group's gather and reduce-scatter (made from ``group`` when not given).
    """

    def __init__(
        self,
        chunk_id: int,
        chunk_size: int,
        dtype: torch.dtype,
        group: dist.ProcessGroup | None,
        compute_device: torch.device,
        keep_gathered: bool = False,
        comm: ChunkComm | None = None,
    ) -> None:
        self.comm = comm if comm is not None else ChunkComm(group)
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        assert chunk_size % self.world_size == 0, (chunk_size, self.world_size)
        self.chunk_id = chunk_id
        self.chunk_size = chunk_size
        self.shard_size = chunk_size // self.world_size
        self.shard_begin = self.rank * self.shard_size
        self.dtype = dtype
        self.group = group
        self.compute_device = compute_device
        self.keep_gathered = keep_gathered
        self.tensors: list[TensorInfo] = []
        self.utilized = 0
        self.device_type = compute_device.type
        self.optim_device = compute_device
        self.optim_on_host = False  # the policy put the optimizer data on the host
        self.pin_memory = False  # pin host-resident shards and masters (accelerator only)
        self.master: torch.Tensor | None = None
        self.shard: torch.Tensor | None = None
        self.payload: torch.Tensor | None = None
        self.grad_payload: torch.Tensor | None = None
        self.grad_shard: torch.Tensor | None = None
        self.grad_dtype = torch.float32  # of a fresh grad_shard (module doc)
        self._pending: Pending | None = None
        self.states: Counter[TensorState] = Counter()
        self.n_trainable = 0
        self.gathers = 0  # all-gathers issued by this chunk (tests count them)

    # ------------------------------------------------------------------ sizes for placement
    @property
    def element_size(self) -> int:
        """Bytes per element of the working dtype."""
        return self.dtype.itemsize

    @property
    def chunk_mem(self) -> int:
        """Bytes of the full payload in the working dtype."""
        return self.chunk_size * self.element_size

    @property
    def shard_mem(self) -> int:
        """Bytes of this rank's working shard (where ``device_type`` says it lives)."""
        return self.shard_size * self.element_size

    @property
    def grad_widening_bytes(self) -> int:
        """Bytes a gradient shard widened to fp32 by accumulation takes beyond ``grad_dtype``."""
        return self.shard_size * (torch.float32.itemsize - self.grad_dtype.itemsize)

    @property
    def holds_grad_shard(self) -> bool:
        """A backward since the last step or ``zero_grad`` left a gradient shard (another
        backward now accumulates onto it)."""
        return self.grad_shard is not None

    @property
    def grad_widened(self) -> bool:
        """Whether the gradient shard is wider than ``grad_dtype`` (accumulation widened it)."""
        return self.grad_shard is not None and self.grad_shard.dtype != self.grad_dtype

    @property
    def is_gathered(self) -> bool:
        """Whether the full payload is present (or being gathered by a prefetch)."""
        return self.payload is not None

    @property
    def can_move(self) -> bool:
        """False while the chunk is gathered and in use (a tensor in COMPUTE)."""
        return self.states[TensorState.COMPUTE] == 0

    @property
    def can_release(self) -> bool:
        """Gathered, not kept gathered, and no tensor in use or waiting for reduction."""
        busy = self.states[TensorState.COMPUTE] + self.states[TensorState.READY_FOR_REDUCE]
        return self.payload is not None and not self.keep_gathered and busy == 0

    @property
    def shard_device(self) -> torch.device:
        """The device of the working shard: ``device_type`` (the compute device's index)."""
        if self.device_type == self.compute_device.type:
            return self.compute_device
        return torch.device(self.device_type)

    # ------------------------------------------------------------------ building
    def append(self, param: nn.Parameter, name: str) -> None:
        """Reserve room for ``param`` at the end of the payload.

        Raises:
            ChunkFullError: the chunk has less room left than ``param`` needs.
        """
        numel = param.numel()
        if self.utilized + numel > self.chunk_size:
            raise ChunkFullError(
                f"chunk {self.chunk_id} has {self.chunk_size - self.utilized} free elements, "
                f"{name} needs {numel}; open a new chunk for it."
            )
        self.tensors.append(TensorInfo(param, name, self.utilized, numel, param.shape))
        self.states[TensorState.FREE] += 1
        self.n_trainable += int(param.requires_grad)
        self.utilized += numel

    def initialise(self, full: torch.Tensor) -> None:
        """Take this rank's slice of ``full`` (the fp32 payload, identical on every rank)."""
        if not self.keep_gathered:
            self.initialise_shard(full[self.shard_begin : self.shard_begin + self.shard_size])
            return
        self.master = full[self.shard_begin : self.shard_begin + self.shard_size].clone()
        self.master = self.pinned(self.master.to(self.optim_device))
        self.payload = full.to(device=self.compute_device, dtype=self.dtype)
        self.shard = self.payload[self.shard_begin : self.shard_begin + self.shard_size]
        self._attach(TensorState.HOLD)

    def initialise_shard(self, shard: torch.Tensor) -> None:
        """Take ``shard`` (this rank's fp32 slice of the payload) as the master of a chunk that
        is not kept gathered — without the rest of the payload ever existing here."""
        assert not self.keep_gathered and shard.numel() == self.shard_size
        master = shard.to(self.optim_device)
        if master is shard and shard._base is not None:  # a view of a whole payload: copy
            master = shard.clone()
        self.master = self.pinned(master)
        self._detach(TensorState.FREE)

    # ------------------------------------------------------------------ states
    def set_state(self, info: TensorInfo, new: TensorState) -> None:
        """Move one tensor to ``new`` (checked against the transition table)."""
        if info.state is new and new is not TensorState.COMPUTE:
            return
        check_transition(info.state, new)
        self.states[info.state] -= 1
        self.states[new] += 1
        info.state = new

    def _attach(self, state: TensorState) -> None:
        assert self.payload is not None
        for info in self.tensors:
            view = self.payload[info.offset : info.offset + info.numel].view(info.shape)
            info.param.data = view
            if info.state is TensorState.FREE:
                self.set_state(info, state)

    def _detach(self, state: TensorState) -> None:
        for info in self.tensors:
            info.param.data = torch.empty(0, dtype=self.dtype, device=self.compute_device)
            if info.state is not state:
                self.set_state(info, state)

    # ------------------------------------------------------------------ gather / release
    def working_shard(self) -> torch.Tensor:
        """The working shard, re-made from the fp32 master when it was dropped."""
        if self.shard is None:
            assert self.master is not None
            with model_data_scope():
                shard = self.master.to(device=self.shard_device, dtype=self.dtype)
                self.shard = self.pinned(shard)
        return self.shard

    def pinned(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` in pinned memory when it is on the host and pinning was asked for."""
        if self.pin_memory and tensor.device.type == "cpu" and not tensor.is_pinned():
            return tensor.pin_memory()
        return tensor

    def gather(self, async_op: bool = False) -> None:
        """All-gather the payload (COLLECTIVE); with ``async_op``, finish later in :meth:`wait`."""
        if self.payload is not None:
            return
        src = self.working_shard()
        with model_data_scope():  # the CPU memory tracer bills chunks to model data
            src = src.to(self.compute_device)
            self.payload = torch.empty(
                self.chunk_size, dtype=self.dtype, device=self.compute_device
            )
        self.gathers += 1
        pending = self.comm.all_gather(self.payload, src, self.chunk_id, async_op=async_op)
        if pending is not None:
            self._pending = pending
            return
        self._attach(TensorState.HOLD)

    def wait(self) -> None:
        """Finish a gather started with ``async_op=True`` (no-op otherwise)."""
        if self._pending is not None:
            self._pending.wait()
            self._pending = None
            self._attach(TensorState.HOLD)

    @property
    def gather_pending(self) -> bool:
        """An asynchronous gather was issued and not waited for yet."""
        return self._pending is not None

    def release(self) -> None:
        """Drop the payload; parameters become empty placeholders."""
        assert self.can_release and self._pending is None, f"chunk {self.chunk_id} is busy"
        self.payload = None
        self._detach(TensorState.FREE)

    # ------------------------------------------------------------------ gradients
    def add_grad(self, info: TensorInfo, grad: torch.Tensor) -> bool:
        """Store ``grad / N`` of one tensor in the gradient payload; True once every trainable
        tensor of the chunk has its gradient (time to :meth:`reduce`)."""
        if self.grad_payload is None:  # the slots no gradient reaches are zeroed in reduce
            own = self.payload if self.grads_in_payload else None
            self.grad_payload = own if own is not None else torch.empty(
                self.chunk_size, dtype=self.dtype, device=self.compute_device
            )  # fmt: skip
        slot = self.grad_payload[info.offset : info.offset + info.numel].view(info.shape)
        info.has_grad = True
        if info.state is TensorState.READY_FOR_REDUCE:
            slot.add_(grad, alpha=1.0 / self.world_size)
        else:
            torch.div(grad, self.world_size, out=slot)
            self.set_state(info, TensorState.READY_FOR_REDUCE)
        return self.states[TensorState.READY_FOR_REDUCE] == self.n_trainable

    @property
    def grads_in_payload(self) -> bool:
        """Gradients are written over the gathered payload (module doc): sharded, gathered, not
        being gathered, and every tensor trainable."""
        return (
            not self.keep_gathered
            and self.payload is not None
            and self._pending is None
            and self.n_trainable == len(self.tensors)
        )

    def reduce(self) -> None:
        """Reduce-scatter the gradient payload and add this rank's part to ``grad_shard``
        (COLLECTIVE). Drops the working shard of a sharded chunk: the master re-makes it."""
        assert self.grad_payload is not None and self.master is not None
        self._zero_unwritten()
        if self.world_size == 1:
            part = self.grad_payload
        else:
            part = torch.empty(self.shard_size, dtype=self.dtype, device=self.compute_device)
            self.comm.reduce_scatter(part, self.grad_payload, self.chunk_id)
        self.grad_payload = None
        if self.grad_shard is None:  # on the master's device: the part itself when it can be
            self.grad_shard = part.to(device=self.master.device, dtype=self.grad_dtype)
        else:  # accumulate in fp32
            if self.grad_shard.dtype != torch.float32:
                self.grad_shard = self.grad_shard.float()
            self.grad_shard.add_(part.to(self.master.device))
        for info in self.tensors:
            if info.state is TensorState.READY_FOR_REDUCE:
                self.set_state(info, TensorState.HOLD_AFTER_BWD)
        if not self.keep_gathered:
            self.shard = None

    def _zero_unwritten(self) -> None:
        """Zero the parts of the gradient payload no gradient was written to: the tail after
        the last tensor and the tensors without a gradient in this backward."""
        assert self.grad_payload is not None
        self.grad_payload[self.utilized :].zero_()
        for info in self.tensors:
            if info.state is not TensorState.READY_FOR_REDUCE:
                self.grad_payload[info.offset : info.offset + info.numel].zero_()

    def drop_grads(self) -> None:
        """Forget the accumulated gradient (after the step, and ``zero_grad``)."""
        self.grad_shard = None
        for info in self.tensors:
            info.has_grad = False

    def end_iteration(self) -> None:
        """After backward: every tensor back to HOLD (gathered) or FREE."""
        target = TensorState.HOLD if self.payload is not None else TensorState.FREE
        for info in self.tensors:
            if info.state is TensorState.COMPUTE and target is TensorState.FREE:
                self.set_state(info, TensorState.HOLD)
            if info.state is not target:
                self.set_state(info, target)

    # ------------------------------------------------------------------ after the step
    def refresh_from_master(self) -> None:
        """Bring the working copy up to date with the stepped master (COLLECTIVE for a kept-
        gathered chunk: its payload is re-gathered; a sharded chunk re-makes it lazily)."""
        assert self.master is not None
        if not self.keep_gathered:
            self.shard = None
            return
        assert self.payload is not None
        assert self.shard is not None  # this rank's slice of the payload
        self.shard.copy_(self.master)
        if self.world_size > 1:  # in place: the input is the output's own slice
            self.comm.all_gather(self.payload, self.shard, self.chunk_id)

    def __repr__(self) -> str:
        return (
            f"Chunk(id={self.chunk_id}, size={self.chunk_size}, used={self.utilized}, "
            f"tensors={len(self.tensors)}, gathered={self.is_gathered}, "
            f"keep_gathered={self.keep_gathered}, device_type={self.device_type!r})"
        )
