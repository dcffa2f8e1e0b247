"""Module and gradient hooks that drive the chunks of a :class:`GeminiDDP` model.

* forward pre-hook of every module with parameters of its own: gather its chunks (after asking
  the placement policy for room) and mark its tensors COMPUTE; in forward, chunks no longer in
  use are released when compute moves on to other chunks, so consecutive modules sharing a chunk
  gather it once;
* forward post-hook: tensors to HOLD_AFTER_FWD, and a hook on each output that needs a gradient:
  when that gradient arrives (before the module's backward runs) the module's chunks are
  gathered again if they were released;
* post-accumulate-grad hook of every trainable parameter: the gradient goes into its chunk's
  gradient payload; once every trainable tensor of a chunk has one, the chunk is
  reduce-scattered and released.

During backward nothing is released before its gradients are reduced, so the recomputation of
activation checkpointing finds its chunks still gathered (and backward finds the recomputation's
chunks gathered): checkpointing adds no all-gather. After the first iteration the order of chunk
accesses is known and the next chunk is prefetched with an asynchronous all-gather — but not
across the end of forward: the first chunk backward gathers is fetched when backward starts, so
it is not alive beside the logits and the loss, where the step peaks.

Two more all-gathers are saved once the first iteration has recorded the accesses (``hold``, on
by default; placements with a device budget turn it off so that the budget alone decides what
stays gathered): in forward a chunk that a later module of the same forward uses again (a tied
LM head, whose weight lives in the embedding's chunk) stays gathered until that last use, and
the chunks that backward needs first (those of the last module) stay gathered from the end of
forward into backward, as FSDP2 keeps its root unit. A held chunk is released at the next
forward or step when no backward came.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from kolossos.zero.gemini.chunk import Chunk, ChunkManager, TensorState

__all__ = ["GeminiHooks", "Phase"]


class Phase(enum.Enum):
    """What the model is doing."""

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


class GeminiHooks:
    """Installs and runs the hooks (see the module docstring).

    Args:
        manager: the model's chunks.
        policy: the placement policy (``before_compute`` / ``after_iteration``).
        prefetch: prefetch the next chunk once the access order is known.
        hold: keep chunks gathered for their next use in the same forward and, at the end of
            forward, for the start of backward (see the module docstring).
    """

    def __init__(
        self, manager: ChunkManager, policy: Any, prefetch: bool = True, hold: bool = True
    ) -> None:
        self.manager = manager
        self.policy = policy
        self.prefetch = prefetch
        self.hold = hold
        self.phase = Phase.IDLE
        self.iteration = 0
        self.moment = 0  # compute accesses in this iteration (the policy's clock)
        self.order: list[int] = []  # chunk access order of the first training iteration
        self.forward_len = 0  # entries of ``order`` recorded by its forward
        self.last_forward_use: dict[int, int] = {}  # chunk id -> its last forward moment
        self.backward_first: set[int] = set()  # chunk ids of the first backward access
        self._cursor = 0
        self.backward_pending = False
        self._handles: list[RemovableHandle] = []

    # ------------------------------------------------------------------ installation
    def install(self, module: nn.Module) -> None:
        """Hook every submodule owning managed parameters, and every trainable parameter."""
        for sub in module.modules():
            own = [p for p in sub.parameters(recurse=False) if self.manager.manages(p)]
            if not own:
                continue
            self._handles.append(sub.register_forward_pre_hook(self._pre_forward_hook(own)))
            self._handles.append(sub.register_forward_hook(self._post_forward_hook(own)))
        for chunk in self.manager:
            for info in chunk.tensors:
                if info.param.requires_grad:
                    hook = self._grad_hook(chunk, info.param)
                    self._handles.append(info.param.register_post_accumulate_grad_hook(hook))

    @property
    def handle_ids(self) -> frozenset[int]:
        """The ids of the installed hooks (keys in the modules' and parameters' hook dicts)."""
        return frozenset(handle.id for handle in self._handles)

    def remove(self) -> None:
        """Remove every hook."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ------------------------------------------------------------------ access
    def access(self, params: list[nn.Parameter], state: TensorState) -> None:
        """Gather the chunks of ``params`` for compute and move the tensors to ``state``."""
        chunks = self.manager.chunks_of(params)
        if self.phase is Phase.FORWARD:
            self._release_others(chunks)
        upcoming = self._upcoming(chunks)
        self.policy.before_compute(chunks + upcoming, self.moment)
        if self.iteration == 0:
            self._record(chunks)
        self.moment += 1
        for chunk in chunks:
            self.manager.gather(chunk)
        for chunk in upcoming:
            self.manager.gather(chunk, async_op=True)
        for p in params:
            chunk, info = self.manager.locate(p)
            if info.state is not TensorState.READY_FOR_REDUCE:
                chunk.set_state(info, state)

    def _record(self, chunks: list[Chunk]) -> None:
        """First iteration: the access order, each chunk's last forward use, and the chunks
        that backward needs first."""
        first_backward = self.phase is Phase.BACKWARD and not self.backward_first
        for chunk in chunks:
            if not self.order or self.order[-1] != chunk.chunk_id:
                self.order.append(chunk.chunk_id)
            if self.phase is Phase.FORWARD:
                self.last_forward_use[chunk.chunk_id] = self.moment
            elif first_backward:
                self.backward_first.add(chunk.chunk_id)

    def _release_others(self, keep: list[Chunk]) -> None:
        """Forward: release the gathered chunks not needed now nor later in this forward."""
        for chunk in list(self.manager.accessed_chunks):
            if chunk in keep or chunk.gather_pending:
                continue
            if self.hold and self.last_forward_use.get(chunk.chunk_id, -1) > self.moment:
                continue  # used again by a later module of this forward (tied weights)
            self.manager.release(chunk)

    def _upcoming(self, chunks: list[Chunk]) -> list[Chunk]:
        """The chunk to prefetch: the one after ``chunks`` in the recorded order."""
        if not self.prefetch or self.iteration == 0 or not self.order or not chunks:
            return []
        last = chunks[-1].chunk_id
        for step in range(len(self.order)):  # search forward from the cursor, wrapping
            pos = (self._cursor + step) % len(self.order)
            if self.order[pos] == last:
                self._cursor = pos
                break
        else:
            return []
        if self._cursor + 1 >= len(self.order):
            return []
        if self.phase is Phase.FORWARD and self._cursor + 1 >= self.forward_len:
            return []  # backward's first chunk is fetched when backward starts, not over the loss
        nxt = self.manager.chunks[self.order[self._cursor + 1]]
        return [] if nxt.is_gathered or nxt in chunks else [nxt]

    # ------------------------------------------------------------------ hooks
    def _pre_forward_hook(self, own: list[nn.Parameter]) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self.access(own, TensorState.COMPUTE)

        return hook

    def _post_forward_hook(self, own: list[nn.Parameter]) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            for p in own:
                chunk, info = self.manager.locate(p)
                if info.state is TensorState.COMPUTE:
                    chunk.set_state(info, TensorState.HOLD_AFTER_FWD)
            if torch.is_grad_enabled():
                for t in _tensors(output):
                    if t.requires_grad and t.grad_fn is not None:
                        t.register_hook(self._pre_backward_hook(own))

        return hook

    def _pre_backward_hook(self, own: list[nn.Parameter]) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self.phase = Phase.BACKWARD
            self.backward_pending = True
            self.access(own, TensorState.COMPUTE)

        return hook

    def _grad_hook(self, chunk: Chunk, param: nn.Parameter) -> Callable[[torch.Tensor], None]:
        info = chunk.tensors[[i.param is param for i in chunk.tensors].index(True)]

        def hook(p: torch.Tensor) -> None:
            grad = p.grad
            p.grad = None
            if grad is None:
                return
            self.phase = Phase.BACKWARD
            self.backward_pending = True
            if chunk.add_grad(info, grad):
                chunk.reduce()
                self.manager.release(chunk)

        return hook

    # ------------------------------------------------------------------ phases
    def start_forward(self) -> None:
        """A forward of the whole model begins."""
        self.finish_backward()
        self._drop_prefetched()
        self.phase = Phase.FORWARD
        self.moment = 0
        self._cursor = 0
        if self.iteration == 0:
            self.order.clear()
            self.last_forward_use.clear()
            self.backward_first.clear()

    def end_forward(self) -> None:
        """The whole model's forward returned (or raised): release what is not kept gathered."""
        for chunk in self.manager.accessed_chunks:
            for info in chunk.tensors:
                if info.state is TensorState.COMPUTE:  # a module raised before its post-hook
                    chunk.set_state(info, TensorState.HOLD_AFTER_FWD)
        backward_follows = torch.is_grad_enabled()
        if self.iteration == 0:
            self.forward_len = len(self.order)
        for chunk in list(self.manager.accessed_chunks):
            if not (backward_follows and self.hold and chunk.chunk_id in self.backward_first):
                self.manager.release(chunk)  # the chunks backward starts with stay gathered
        if not backward_follows:  # no backward follows: drop prefetched chunks too
            self._drop_prefetched()
        self.phase = Phase.IDLE

    def _drop_prefetched(self) -> None:
        """Finish and release chunks prefetched for a use that did not come."""
        for chunk in list(self.manager.accessed_chunks):
            if chunk.gather_pending:
                chunk.wait()
                self.manager.release(chunk)

    def finish_backward(self) -> None:
        """Reduce the chunks whose gradients are incomplete (unused parameters), release
        everything and close the iteration (COLLECTIVE). Without a pending backward it only
        releases the chunks a forward held for one (the step must not leave them stale)."""
        if not self.backward_pending:
            if self.phase is Phase.IDLE:
                self._drop_prefetched()
                self.manager.release_all()
            return
        for chunk in self.manager:
            chunk.wait()
            if chunk.states[TensorState.READY_FOR_REDUCE]:
                chunk.reduce()
        for chunk in self.manager:
            chunk.end_iteration()
        self.manager.release_all()
        self.policy.after_iteration()
        self.backward_pending = False
        self.phase = Phase.IDLE
        self.iteration += 1


def _tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor inside ``value`` (tensors, lists, tuples, dicts and ModelOutputs)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []
