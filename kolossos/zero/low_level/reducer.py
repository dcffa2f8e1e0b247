"""Gradient reduction for ZeRO-1/2: post-accumulate-grad hooks fill buckets, buckets go to their
owners as soon as they are complete (overlapping the rest of backward), in a fixed order.

A parameter's hook runs once its gradient for the backward pass (``begin`` ... autograd ...
``finish``) is final (``register_post_accumulate_grad_hook``). A pass takes one of two paths:

* **Partitioned** (ZeRO-2 always; ZeRO-1 while its flat gradient buffer holds nothing, i.e.
  every synchronised pass as long as no ``no_sync`` pass ran since ``zero_grad``): the hook
  copies the gradient into the buckets it overlaps (cast to the communication dtype) and frees
  ``.grad`` at once; a bucket lying inside one gradient of the communication dtype is sent from
  that gradient itself, without the copy (the gradient then lives until its buckets are
  reduced; GPT-2's token embedding is most of a small model's gradient). Owners add the
  reduced buckets into their gradient partition (:class:`GradStore`). No full gradient exists
  beyond autograd's own tensors, so ZeRO-1 outside gradient accumulation costs what ZeRO-2
  costs, in memory and in copies. With two
  gloo ranks (point-to-point reduction, :mod:`~kolossos.zero.low_level.comm`) the owner of a
  bucket adds its own gradients straight into its partition and only receives the other
  rank's part, so each rank holds one buffer per bucket in flight.
* **Flat** (ZeRO-1 once gradients were accumulated locally since ``zero_grad``: ``no_sync``
  passes, a pipeline step's micro-batches, and the synchronised passes after them): the hook
  keeps the gradient in the flat gradient buffer (the ``.grad`` becomes a view of it). The
  buffer is never zeroed as a whole: after ``zero_grad`` (:meth:`forget_local`) every
  parameter's range is *unwritten*, its ``.grad`` is ``None``, autograd hands the hook a fresh
  gradient and the hook copies it into the range (one pass, where zeroing the buffer and
  accumulating into it took three). Later passes accumulate into the view as usual. Ranges
  still unwritten when their bucket is reduced are zeroed then, the bucket's range is reduced
  in place to its owner, and the non-owners zero their copy; the owner's reduced range becomes
  (or, after a partitioned pass, is added into) its partition. The buffers themselves are
  freed by ``zero_grad`` (:mod:`~kolossos.zero.low_level.grad_buffers`).

Either way:

1. A bucket whose pieces have all arrived is *ready*. Ready buckets are launched strictly in
   bucket order (:mod:`~kolossos.zero.low_level.bucket`), so all ranks issue the same
   collectives in the same order even if their gradients arrive in different orders. Both
   paths send the same messages (only where a rank keeps the gradients differs), so ranks
   whose paths differ still match. With ``overlap`` the reduce is asynchronous, at most
   ``MAX_IN_FLIGHT`` buckets at a time (bounding buffer memory); without it a partitioned pass
   waits at once and a flat pass launches everything when backward ends.
2. ``finish`` launches the buckets still waiting (parameters that got no gradient contribute
   zeros), waits for all of them and hands each owner's result to the :class:`GradStore`. The
   bucket buffers are freed: between backward passes no communication memory is held.

The loss was divided by the data-parallel size before backward, so a plain sum is the average.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kolossos.zero.low_level.bucket import BucketSpec, BufferPool, buckets_of_params
from kolossos.zero.low_level.comm import Communicator, Handle
from kolossos.zero.low_level.grad_buffers import FlatGradBuffers
from kolossos.zero.low_level.grad_store import GradStore
from kolossos.zero.low_level.partition import FlatLayout

__all__ = ["MAX_IN_FLIGHT", "GradientReducer"]

#: buckets being reduced at once (more in flight only buys memory on a saturated link)
MAX_IN_FLIGHT = 2

_OUTSIDE_BACKWARD = (
    "a ZeRO-managed parameter received a gradient outside optimizer.backward(); with "
    "LowLevelZeroPlugin call booster.backward(loss, optimizer) (or optimizer.backward(loss)) "
    "instead of loss.backward(): the optimizer scales the loss and reduces the gradients."
)


@dataclass
class _Flight:
    """A launched bucket."""

    bucket: BucketSpec
    handle: Handle
    result: torch.Tensor | None
    """on the owner, what to store once ``handle`` is done (``None`` on other ranks)"""
    pooled: list[torch.Tensor]
    """pool buffers to give back once ``handle`` is done"""
    borrowed: torch.Tensor | None = None
    """a gradient sent in place, kept alive until ``handle`` is done"""


class GradientReducer:
    """Hooks, buckets and reduce-to-owner for one :class:`LowLevelZeroOptimizer`.

    Args:
        params: the managed working parameters, group by group.
        layouts: the groups' flat layouts.
        buckets: the bucket plan (``plan_buckets``).
        comm: the data-parallel communicator.
        store: where owners keep the reduced gradients.
        flat_grads: ZeRO-1's full flat gradient buffers (``None`` for ZeRO-2).
        comm_dtype: dtype gradients travel in.
        overlap: reduce asynchronously while backward continues.
    """

    def __init__(
        self,
        params: Sequence[Sequence[torch.Tensor]],
        layouts: Sequence[FlatLayout],
        buckets: Sequence[BucketSpec],
        comm: Communicator,
        store: GradStore,
        flat_grads: FlatGradBuffers | None,
        comm_dtype: torch.dtype,
        overlap: bool,
    ) -> None:
        self.params = [list(g) for g in params]
        self.layouts = list(layouts)
        self.buckets = list(buckets)
        self.comm = comm
        self.store = store
        self.flat_grads = flat_grads
        self.partition_grads = flat_grads is None  # ZeRO-2
        #: this pass keeps only partitions (see the module doc); always for ZeRO-2
        self._lean = self.partition_grads
        #: ZeRO-1: whether a parameter's range of the flat gradient buffer holds this rank's
        #: current gradient (``False``: stale or freed, to be overwritten or zeroed)
        self._written = [[False] * len(g) for g in self.params]
        self.comm_dtype = comm_dtype
        self.overlap = overlap
        self._of_param = buckets_of_params(self.buckets, [len(g) for g in self.params])
        device = next((p.device for g in self.params for p in g), torch.device("cpu"))
        capacity = max((b.numel for b in self.buckets), default=0)
        self.pool = BufferPool(capacity, comm_dtype, device)
        self._pending = [len(b.pieces) for b in self.buckets]
        self._fired = [[False] * len(g) for g in self.params]
        self._staged: dict[int, torch.Tensor] = {}
        self._borrowed: set[int] = set()  # staged buckets that are views of a gradient
        self._inflight: deque[_Flight] = deque()
        self._next = 0
        self._active = False
        self._sync = True
        #: ZeRO-1 gradients accumulated locally (``no_sync``) and not reduced yet
        self.local_unreduced = False
        self._handles: list[Any] = []

    # ------------------------------------------------------------------ hooks
    def register_hooks(self) -> None:
        """Install the post-accumulate-grad hook on every managed parameter."""
        for g, group in enumerate(self.params):
            for i, param in enumerate(group):
                if param.requires_grad:
                    self._handles.append(param.register_post_accumulate_grad_hook(self._hook(g, i)))

    def remove_hooks(self) -> None:
        """Remove the hooks (the optimizer is being discarded)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, g: int, i: int) -> Any:
        def hook(param: torch.Tensor) -> None:
            self.on_grad(g, i, param)

        return hook

    def on_grad(self, g: int, i: int, param: torch.Tensor) -> None:
        """The gradient of parameter ``i`` of group ``g`` is final for this backward pass."""
        if not self._active:
            raise RuntimeError(_OUTSIDE_BACKWARD)
        if not self._lean:
            self._adopt(g, i, param)
        if not self._sync:  # ZeRO-1 under no_sync: keep accumulating in the flat buffer
            return
        if self._fired[g][i]:
            raise RuntimeError(
                f"parameter {i} of param group {g} received its gradient twice in one backward "
                "pass (e.g. used inside and outside a reentrant activation checkpoint); ZeRO "
                "reduces each gradient once per pass: use checkpoint(..., use_reentrant=False)."
            )
        self._fired[g][i] = True
        for b, piece in self._of_param[g][i]:
            if self._lean:
                assert param.grad is not None
                self._stage(b, g, i, piece.lo, piece.hi, param.grad)
            self._pending[b] -= 1
        if self._lean:
            param.grad = None  # the full gradient is not kept
        if self.overlap or self._lean:
            self._launch_ready()
        self._poll()

    def _adopt(self, g: int, i: int, param: torch.Tensor) -> None:
        """ZeRO-1: copy the parameter's ``.grad`` (autograd's fresh tensor) into its flat
        range and make ``.grad`` the view of it."""
        assert self.flat_grads is not None
        grad = param.grad
        if grad is None or (self.flat_grads.alive(g) and grad is self.flat_grads.views(g)[i]):
            return
        view = self.flat_grads.views(g)[i]
        view.copy_(grad)  # autograd fills a .grad that is None: the whole gradient so far
        self._written[g][i] = True
        param.grad = view

    def attach_grads(self) -> None:
        """ZeRO-1, before a backward pass and before reducing: written ranges become the
        ``.grad`` (autograd accumulates into them in place); a gradient someone replaced is
        copied in, and one set to ``None`` (``model.zero_grad()``) makes its range unwritten."""
        assert self.flat_grads is not None
        for g, (group, written) in enumerate(zip(self.params, self._written, strict=True)):
            for i, param in enumerate(group):
                grad = param.grad
                if grad is None:
                    written[i] = False
                    continue
                view = self.flat_grads.views(g)[i]
                if grad is view:
                    continue
                view.copy_(grad)
                written[i] = True
                param.grad = view

    def forget_local(self) -> None:
        """ZeRO-1 ``zero_grad``: every range unwritten, every ``.grad`` ``None`` and the flat
        buffers freed (the next pass allocates and overwrites them)."""
        assert self.flat_grads is not None
        self.flat_grads.free()
        for group, written in zip(self.params, self._written, strict=True):
            for i, param in enumerate(group):
                written[i] = False
                param.grad = None
        self.local_unreduced = False

    def _owner_direct(self, bucket: BucketSpec) -> bool:
        """Partitioned pass, pairwise: the owner keeps its own part in the store, receives
        the other."""
        return self._lean and self.comm.pairwise and bucket.owner == self.comm.rank

    def _stage(self, b: int, g: int, i: int, lo: int, hi: int, grad: torch.Tensor) -> None:
        bucket = self.buckets[b]
        offset = self.layouts[g].spans[i].offset
        source = grad.reshape(-1)[lo - offset : hi - offset]
        if self._owner_direct(bucket):
            self.store.accumulate(g, lo, source)
            return
        if len(bucket.pieces) == 1 and source.dtype == self.comm_dtype:
            self._staged[b] = source  # the gradient is discarded after this hook: send it
            self._borrowed.add(b)
            return
        buffer = self._staged.get(b)
        if buffer is None:
            buffer = self._staged[b] = self._acquire(bucket.numel)
        buffer[lo - bucket.start : hi - bucket.start].copy_(source)

    # ------------------------------------------------------------------ per backward
    def begin(self, sync: bool) -> None:
        """Start a backward pass; ``sync=False`` (ZeRO-1 ``no_sync``) only accumulates.

        ZeRO-1 calls :meth:`attach_grads` first, so that gradients set from outside count as
        local ones."""
        if self._active:
            raise RuntimeError("optimizer.backward() was called again before the last one ended.")
        self._active = True
        self._sync = sync or self.partition_grads
        self._lean = self.partition_grads or (self._sync and not self._holds_local())
        if self._sync:
            self._reset(fired=False)

    def _holds_local(self) -> bool:
        """ZeRO-1: whether some range of the flat gradient buffer holds a gradient."""
        return any(any(written) for written in self._written)

    def _reset(self, fired: bool) -> None:
        self._pending = [len(b.pieces) for b in self.buckets]
        self._fired = [[fired] * len(g) for g in self.params]
        self._next = 0

    def finish(self) -> None:
        """End a backward pass: launch what is left, wait for everything, store the results."""
        try:
            if self._sync:
                self.reduce_remaining()
            else:
                self.local_unreduced = True
        finally:
            self._active = False

    def abort(self) -> None:
        """Leave the backward state after an exception inside autograd."""
        self._active = False

    def reduce_remaining(self) -> None:
        """Launch every bucket not launched yet (in order), then wait for all of them."""
        if not self._lean:
            self.attach_grads()  # gradients set from outside autograd (pipelines' shared ones)
        while self._next < len(self.buckets):
            self._launch(self._next)
            self._next += 1
        if self.flat_grads is not None and not self._lean:  # unreached ranges: zeroed at launch
            for g, (group, written) in enumerate(zip(self.params, self._written, strict=True)):
                written[:] = [True] * len(written)
                for param, view in zip(group, self.flat_grads.views(g), strict=True):
                    param.grad = view
        self._drain()
        self.pool.clear()  # no bucket memory between backward passes (the activation peak)
        self.local_unreduced = False

    def reduce_all(self) -> None:
        """Reduce ZeRO-1's locally accumulated gradients now (a step after ``no_sync`` passes
        without a final synchronising backward)."""
        self._lean = False
        self._reset(fired=True)
        self.reduce_remaining()

    # ------------------------------------------------------------------ buckets
    def _acquire(self, numel: int) -> torch.Tensor:
        """A pooled buffer; waits for the oldest bucket in flight when too many are."""
        while len(self._inflight) >= MAX_IN_FLIGHT:
            self._complete(self._inflight.popleft())
        return self.pool.acquire(numel)

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            self._launch(self._next)
            self._next += 1
            if not self.overlap:
                self._drain()

    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        owner = bucket.owner == self.comm.rank
        if self._owner_direct(bucket):  # own part already in the store: receive the other
            received = self._acquire(bucket.numel)
            handle = self.comm.receive_from_peer(received, b)
            self._inflight.append(_Flight(bucket, handle, received, [received]))
            return
        pooled: list[torch.Tensor] = []
        borrowed: torch.Tensor | None = None
        if self._lean:
            send = self._staged.pop(b, None)
            if send is None:
                send = self._acquire(bucket.numel).zero_()
            elif self._pending[b]:  # parameters without a gradient this pass contribute zeros
                for piece in bucket.pieces:
                    if not self._fired[bucket.group][piece.param]:
                        send[piece.lo - bucket.start : piece.hi - bucket.start].zero_()
            if b in self._borrowed:
                self._borrowed.discard(b)
                borrowed = send
            else:
                pooled.append(send)
        else:
            send = self._region(bucket)
            self._zero_unwritten(bucket)
            if send.dtype != self.comm_dtype:  # a cast copy in the communication dtype
                send = self._acquire(bucket.numel).copy_(send)
                pooled.append(send)
        scratch = self._acquire(bucket.numel) if owner and self.comm.pairwise else None
        if scratch is not None:
            pooled.append(scratch)
        handle = self.comm.reduce_to_owner(send, bucket.owner, b, scratch)
        self._inflight.append(_Flight(bucket, handle, send if owner else None, pooled, borrowed))

    def _zero_unwritten(self, bucket: BucketSpec) -> None:
        """ZeRO-1: zero the bucket's ranges that no gradient reached since ``zero_grad``."""
        assert self.flat_grads is not None
        flat, written = self.flat_grads[bucket.group], self._written[bucket.group]
        for piece in bucket.pieces:
            if not written[piece.param]:
                flat[piece.lo : piece.hi].zero_()

    def _owned(self, group: int) -> torch.Tensor:
        """ZeRO-1: this rank's partition of group ``group``'s flat gradient buffer."""
        assert self.flat_grads is not None
        start, stop = self.layouts[group].partition_range(self.comm.rank)
        return self.flat_grads[group][start:stop]

    def _region(self, bucket: BucketSpec) -> torch.Tensor:
        assert self.flat_grads is not None
        return self.flat_grads[bucket.group][bucket.start : bucket.stop]

    def _poll(self) -> None:
        while self._inflight and self._inflight[0].handle.is_completed():
            self._complete(self._inflight.popleft())

    def _drain(self) -> None:
        while self._inflight:
            self._complete(self._inflight.popleft())

    def _complete(self, flight: _Flight) -> None:
        flight.handle.wait()
        bucket, result = flight.bucket, flight.result
        if self._lean:
            if result is not None:
                self.store.accumulate(bucket.group, bucket.start, result)
        else:
            region = self._region(bucket)
            if result is not None:  # the owner
                if result.dtype != region.dtype:
                    region.copy_(result)
                if not self.store.keep_in_place(bucket.group, self._owned(bucket.group)):
                    self.store.accumulate(bucket.group, bucket.start, region)
                    region.zero_()  # moved out: the flat buffer stays clean
            else:
                region.zero_()  # the other ranks' share now lives with its owner
        for buffer in flight.pooled:
            self.pool.release(buffer)
