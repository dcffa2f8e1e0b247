"""Replay a :class:`~kolossos.lazy.tape.Tape` on real tensors, keeping only what is wanted.

:func:`replay` walks the tape once, in program order, and hands each wanted storage to its sink
as soon as its last write has run. Three rules keep memory at "what the sinks keep, plus a few
tensors in flight", never the whole model:

* an op runs only if its result reaches a wanted storage (dead code is skipped), except random
  ops, which always run so that every later draw sees the same generator state as the eager
  build — on a scratch tensor of the storage's size when nothing wants the result;
* a storage is freed right after its last use (a read, or its delivery to the sink);
* a storage whose next op overwrites all of it (``normal_`` after ``kaiming_uniform_``, as every
  Hugging Face model's ``post_init`` does) is freed until then.

Random ops draw from private generators set to the recorded states, so replaying changes no
global random state.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from kolossos.lazy.recorder import default_generator
from kolossos.lazy.tape import Tape, TapeOp, TensorRef

__all__ = ["Sink", "replay", "view_of"]

Sink = Callable[[torch.UntypedStorage], None]
"""Receives the final real storage of a wanted key; keeps what it needs of it."""


def view_of(storage: torch.UntypedStorage, ref: TensorRef) -> torch.Tensor:
    """The tensor ``ref`` describes, on ``storage`` (no copy)."""
    tensor = torch.empty(0, dtype=ref.dtype, device=storage.device)
    return tensor.set_(storage, ref.offset, ref.size, ref.stride)


@dataclass
class _Plan:
    """What the backward analysis decided for each op."""

    run: list[bool]
    """Whether the op's result is needed."""
    free_after: list[list[int]]
    """Keys not needed after the op (freed once it has run and deliveries are done)."""
    deliver_after: list[list[int]]
    """Wanted keys whose final value exists after the op."""


def _plan(tape: Tape, wanted: set[int]) -> _Plan:
    ops = tape.ops
    final_at: dict[int, int] = {}
    for i, op in enumerate(ops):
        for key in op.writes | {ref.key for _, ref in op.creates}:
            if key in wanted:
                final_at[key] = i
    missing = wanted - set(final_at)
    if missing:
        raise ValueError(f"replay: storages {sorted(missing)} are not built by this tape.")
    deliver: list[list[int]] = [[] for _ in ops]
    for key, i in final_at.items():
        deliver[i].append(key)
    run = [False] * len(ops)
    free_after: list[list[int]] = [[] for _ in ops]
    live: set[int] = set()  # keys whose value is needed after the op being looked at
    for i in range(len(ops) - 1, -1, -1):
        op = ops[i]
        created = {ref.key for _, ref in op.creates}
        touched = op.reads | op.writes | created
        after = live | set(deliver[i])
        run[i] = bool((op.writes | created) & after)
        free_after[i] = [k for k in touched if k not in live]
        if run[i]:
            live = (live - op.overwrites - created) | op.reads
        else:
            live = live - op.overwrites - created
    return _Plan(run=run, free_after=free_after, deliver_after=deliver)


def _arguments(
    op: TapeOp, values: dict[int, torch.UntypedStorage], tape: Tape
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    flat, spec = tree_flatten((op.args, op.kwargs))
    real: list[Any] = []
    for x in flat:
        if isinstance(x, TensorRef):
            storage = values.get(x.key)
            if storage is None:  # about to be overwritten, or a scratch draw
                device = tape.devices[x.key]
                raw = torch.empty(tape.nbytes[x.key], dtype=torch.uint8, device=device)
                storage = raw.untyped_storage()
                values[x.key] = storage
            real.append(view_of(storage, x))
        else:
            real.append(x)
    args, kwargs = tree_unflatten(real, spec)
    return args, kwargs


def _keep_outputs(op: TapeOp, out: Any, values: dict[int, torch.UntypedStorage]) -> None:
    flat, _ = tree_flatten(out)
    for position, ref in op.creates:
        tensor = flat[position]
        geometry = (tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset())
        if geometry != (ref.size, ref.stride, ref.offset):  # lay it out as the meta run did
            nbytes = tensor.untyped_storage().nbytes()
            raw = torch.empty(nbytes, dtype=torch.uint8, device=tensor.device).untyped_storage()
            view_of(raw, ref).copy_(tensor)
            values[ref.key] = raw
        else:
            values[ref.key] = tensor.untyped_storage()


def _draw(op: TapeOp, args: tuple[Any, ...], kwargs: dict[str, Any], twin: torch.Generator) -> Any:
    """Run a random op drawing from ``twin``. Ops that drew from the default generator may have
    no ``generator`` argument (``randn.default``): the default generator is lent ``twin``'s state
    for the call and given its own back."""
    if op.explicit_generator:
        return op.func(*args, generator=twin, **kwargs)
    default = default_generator(twin.device)
    saved = default.get_state()
    default.set_state(twin.get_state())
    try:
        out = op.func(*args, **kwargs)
        twin.set_state(default.get_state())
    finally:
        default.set_state(saved)
    return out


def replay(tape: Tape, sinks: Mapping[int, Sink]) -> None:
    """Run ``tape`` and call ``sinks[key](storage)`` with the final value of each wanted storage.

    Args:
        tape: the recorded construction.
        sinks: storage key -> what to do with its final value (called once, in tape order).

    Raises:
        ValueError: a wanted key the tape does not build.
    """
    plan = _plan(tape, set(sinks))
    twins = []
    for device, state in tape.generators:
        twin = torch.Generator(device=device)
        twin.set_state(state)
        twins.append(twin)
    values: dict[int, torch.UntypedStorage] = {}
    for i, op in enumerate(tape.ops):
        if not plan.run[i] and op.generator is None:
            continue
        args, kwargs = _arguments(op, values, tape)
        if op.generator is None:
            out = op.func(*args, **kwargs)
        else:
            twin = twins[op.generator]
            if op.reseed is not None:
                twin.set_state(op.reseed)
            out = _draw(op, args, kwargs, twin)
        _keep_outputs(op, out, values)
        for key in plan.deliver_after[i]:
            sinks[key](values[key])
        for key in plan.free_after[i]:
            values.pop(key, None)
