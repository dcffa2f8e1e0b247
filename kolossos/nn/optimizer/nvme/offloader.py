"""Streams offloaded optimizer states through memory during ``step()``.

In each step the units (see :mod:`.plan`) of every parameter group go, in file order, through one
three-stage pipeline::

    reader thread:   read u1    read u2    read u3
    main thread:           update u0  update u1  update u2
    writer thread:                    write u0   write u1   write u2

Three staging buffers of one unit each rotate through the stages, so at most three units of states
are in memory at once, whatever the model's size. The last writes stay in flight when ``step()``
returns and overlap the next forward and backward; they are waited for at the start of the next
step, of ``state_dict()`` or ``load_state_dict()``. Errors of the I/O threads are raised in the
main thread. The I/O threads only make system calls (no torch kernels, so no thread pool of
their own and no oversubscription).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import Tensor

from kolossos.nn.optimizer.nvme.plan import Segment, Unit, plan_units
from kolossos.nn.optimizer.nvme.swap_file import SwapFile

__all__ = ["DEFAULT_UNIT_BYTES", "StateOffloader", "UpdateFn"]

#: bytes of states per unit (16 MiB: 2 Mi elements of fp32 exp_avg + exp_avg_sq)
DEFAULT_UNIT_BYTES = 16 << 20
_BUFFERS = 3

#: ``update(params, grads, states, steps)``: ``states[j]`` are the slices of state ``j``
UpdateFn = Callable[[list[Tensor], list[Tensor], list[list[Tensor]], list[Tensor]], None]


class StateOffloader:
    """Keeps the states of some parameters in a :class:`SwapFile` and streams them per step.

    Args:
        params: the offloaded parameters (CPU, contiguous), with their group index.
        state_names: names of the per-element states, e.g. ``("exp_avg", "exp_avg_sq")``.
        state_dtype: dtype of the states of a parameter.
        directory: ``nvme_offload_dir`` (``None``: a private temporary directory).
        unit_bytes: bytes of states per streamed unit.

    Raises:
        NVMeOffloadError: the directory is unwritable or too small (see :class:`SwapFile`).
    """

    def __init__(
        self,
        params: Sequence[tuple[int, Tensor]],
        state_names: tuple[str, ...],
        state_dtype: Callable[[Tensor], torch.dtype],
        directory: str | os.PathLike[str] | None,
        unit_bytes: int = DEFAULT_UNIT_BYTES,
    ) -> None:
        self.params = [p for _, p in params]
        self.state_names = state_names
        self._index = {id(p): i for i, p in enumerate(self.params)}
        k = len(state_names)
        dtypes = [state_dtype(p) for p in self.params]
        unit_numel = unit_bytes // (k * max((d.itemsize for d in dtypes), default=4))
        spec = [(g, p.numel(), d) for (g, p), d in zip(params, dtypes, strict=True)]
        self.units = plan_units(spec, k, unit_numel)
        self._by_param: dict[int, list[Unit]] = {}
        for unit in self.units:
            for seg in unit.segments:
                self._by_param.setdefault(seg.param, []).append(unit)
        total = self.units[-1].file_offset + self.units[-1].nbytes if self.units else 0
        self.swap = SwapFile(directory, total)
        self._free: list[Tensor] = []
        self._allocated = 0
        self._writes: deque[tuple[Tensor, Future[None]]] = deque()
        self._reader: ThreadPoolExecutor | None = None
        self._writer: ThreadPoolExecutor | None = None

    @property
    def offloaded_bytes(self) -> int:
        """Bytes of optimizer states that live on disk."""
        return sum(u.nbytes for u in self.units)

    def holds(self, p: Tensor) -> bool:
        """Whether ``p``'s states are offloaded."""
        return id(p) in self._index

    def step(
        self,
        work: dict[int, tuple[list[Tensor], list[Tensor]]],
        updates: dict[int, UpdateFn],
    ) -> None:
        """Update offloaded parameters that have gradients, all groups in one pipeline.

        Args:
            work: group index -> (its offloaded parameters with gradients, their steps).
            updates: group index -> the update to apply to that group's units.
        """
        step_of = {
            self._index[id(p)]: s
            for params, steps in work.values()
            for p, s in zip(params, steps, strict=True)
        }
        units = [u for u in self.units if any(s.param in step_of for s in u.segments)]
        if not units:
            return
        self._start_threads()
        reads: deque[tuple[Tensor, Future[None] | None]] = deque([self._submit_read(units[0])])
        try:
            for i, unit in enumerate(units):
                buf, pending = reads[0]
                if pending is not None:
                    pending.result()
                else:
                    buf.zero_()
                if i + 1 < len(units):
                    reads.append(self._submit_read(units[i + 1]))
                self._update_unit(unit, buf, step_of, updates[unit.group])
                reads.popleft()
                unit.initialized = True
                assert self._writer is not None
                self._writes.append((buf, self._writer.submit(self._write, unit, buf)))
        except BaseException:
            self._recover(reads)
            raise

    def _recover(self, reads: deque[tuple[Tensor, Future[None] | None]]) -> None:
        """After a failed step: settle every transfer and return all buffers to the pool (the
        units not yet written keep their pre-step states on disk)."""
        for buf, pending in reads:
            if pending is not None:
                pending.exception()
            self._free.append(buf)
        while self._writes:
            buf, pending = self._writes.popleft()
            pending.exception()
            self._free.append(buf)

    def drain(self) -> None:
        """Wait for the writes in flight (raising their errors); all buffers become free."""
        error: BaseException | None = None
        while self._writes:
            buf, pending = self._writes.popleft()
            self._free.append(buf)
            error = error or pending.exception()
        if error is not None:
            raise error

    def read_param_state(self, p: Tensor) -> dict[str, Tensor]:
        """Fresh tensors holding ``p``'s offloaded states (zeros before its first update)."""
        self.drain()
        index = self._index[id(p)]
        dtype = self._by_param[index][0].dtype
        out = {name: torch.zeros(p.shape, dtype=dtype) for name in self.state_names}
        for unit, seg, j, name in self._regions(index):
            if unit.initialized:
                begin, _ = unit.state_block(j)
                dst = out[name].view(-1)[seg.start : seg.stop].view(torch.uint8)
                self.swap.read(unit.file_offset + begin + seg.offset * dtype.itemsize, dst)
        return out

    def write_param_state(self, p: Tensor, states: dict[str, Tensor] | None) -> None:
        """Store ``states`` (or zeros, for ``None`` or a missing name) as ``p``'s states."""
        self.drain()
        index = self._index[id(p)]
        dtype = self._by_param[index][0].dtype
        zeros = torch.zeros(p.numel(), dtype=dtype)
        for unit, seg, j, name in self._regions(index):
            src = zeros if states is None or name not in states else states[name]
            flat = src.detach().to(device="cpu", dtype=dtype).reshape(-1).contiguous()
            if flat.numel() != p.numel():
                raise ValueError(
                    f"state {name!r} has {flat.numel()} elements, its parameter {p.numel()}"
                )
            if not unit.initialized:  # the rest of the unit must read as zeros from now on
                unit.initialized = True
            begin, _ = unit.state_block(j)
            data = flat[seg.start : seg.stop].view(torch.uint8)
            self.swap.write(unit.file_offset + begin + seg.offset * dtype.itemsize, data)

    def close(self) -> None:
        """Finish the writes, stop the threads and release the file. Idempotent."""
        try:
            self.drain()
        finally:
            for pool in (self._reader, self._writer):
                if pool is not None:
                    pool.shutdown(wait=True)
            self._reader = self._writer = None
            self.swap.close()

    # internals
    def _regions(self, index: int) -> Iterator[tuple[Unit, Segment, int, str]]:
        for unit in self._by_param[index]:
            for seg in unit.segments:
                if seg.param == index:
                    for j, name in enumerate(self.state_names):
                        yield unit, seg, j, name

    def _start_threads(self) -> None:
        if self._reader is None:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="kolossos-nvme-read")
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="kolossos-nvme-write")

    def _buffer(self) -> Tensor:
        if self._free:
            return self._free.pop()
        if self._allocated < _BUFFERS:
            self._allocated += 1
            return torch.empty(max(u.nbytes for u in self.units), dtype=torch.uint8)
        buf, pending = self._writes.popleft()  # reuse the oldest buffer once it is on disk
        pending.result()
        return buf

    def _submit_read(self, unit: Unit) -> tuple[Tensor, Future[None] | None]:
        buf = self._buffer()
        if not unit.initialized:
            return buf, None  # zero-filled by the main thread right before use
        assert self._reader is not None
        return buf, self._reader.submit(self.swap.read, unit.file_offset, buf[: unit.nbytes])

    def _write(self, unit: Unit, buf: Tensor) -> None:
        self.swap.write(unit.file_offset, buf[: unit.nbytes])

    def _update_unit(
        self, unit: Unit, buf: Tensor, step_of: dict[int, Tensor], update: UpdateFn
    ) -> None:
        views = [buf[slice(*unit.state_block(j))].view(unit.dtype) for j in range(unit.num_states)]
        params, grads, steps = [], [], []
        states: list[list[Tensor]] = [[] for _ in range(unit.num_states)]
        for seg in unit.segments:
            if seg.param not in step_of:
                continue  # no gradient this step: its states pass through unchanged
            p = self.params[seg.param]
            assert p.grad is not None
            params.append(p.view(-1)[seg.start : seg.stop])
            grads.append(p.grad.reshape(-1)[seg.start : seg.stop])
            steps.append(step_of[seg.param])
            for j in range(unit.num_states):
                states[j].append(views[j][seg.offset : seg.offset + seg.numel])
        update(params, grads, states, steps)
