"""Turn lazily built tensors into real ones: all of a module, or only the part a rank keeps.

:func:`replay_tensors` is what the plugins use: it computes the final value of each given lazy
tensor, one at a time in construction order, and hands it to a callback that keeps what this rank
owns (a ZeRO chunk's slice, an FSDP shard, ...). :func:`materialize_module` swaps real tensors into
a module in place — the ``Parameter`` objects stay the same, so an optimizer built on the lazy
model keeps working, and tied weights stay tied.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from kolossos.lazy.replay import Sink, replay, view_of
from kolossos.lazy.tape import Tape, lazy_storage, ref_of

__all__ = [
    "is_lazy",
    "is_lazy_module",
    "lazy_named_tensors",
    "materialize_module",
    "materialize_on",
    "module_tape",
    "replay_tensors",
    "swap_in",
    "sync_generators",
]

Keep = Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]
"""``(name, lazy tensor, full value) -> what this rank keeps`` (:func:`materialize_module`)."""


def is_lazy(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` was built inside a :class:`~kolossos.lazy.LazyInitContext` and is not
    materialised yet."""
    return lazy_storage(tensor) is not None


def lazy_named_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The lazy parameters and buffers of ``module`` (each object once, tied ones under their
    first name)."""
    seen: set[int] = set()
    for name, tensor in list(module.named_parameters(remove_duplicate=False)) + list(
        module.named_buffers(remove_duplicate=False)
    ):
        if id(tensor) in seen or not is_lazy(tensor):
            continue
        seen.add(id(tensor))
        yield name, tensor


def is_lazy_module(module: nn.Module) -> bool:
    """Whether ``module`` has a lazy parameter or buffer."""
    return next(lazy_named_tensors(module), None) is not None


def module_tape(module: nn.Module) -> Tape | None:
    """The tape of ``module``'s lazy tensors (``None`` without any).

    Raises:
        ValueError: the tensors come from two different contexts.
    """
    tapes = {id(r.tape): r.tape for _, t in lazy_named_tensors(module) if (r := lazy_storage(t))}
    if len(tapes) > 1:
        raise ValueError(
            f"the module's tensors were built in {len(tapes)} different LazyInitContexts; build "
            "one model in one context (or materialise each part before combining them)."
        )
    return next(iter(tapes.values()), None)


def sync_generators(tape: Tape, group: dist.ProcessGroup | None = None, src: int = 0) -> None:
    """Make every rank of ``group`` replay with the random states of global rank ``src``
    (COLLECTIVE), so that lazily built models agree across ranks as eager ones broadcast from
    ``src`` do. No-op without a process group."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    reseeded = [op for op in tape.ops if op.reseed is not None]
    states = [state for _, state in tape.generators] + [op.reseed for op in reseeded]
    box: list[object] = [states]
    # SYNC POINT: a few KiB of generator states; every rank must materialise the same model.
    dist.broadcast_object_list(box, src=src, group=group)
    received = box[0]
    assert isinstance(received, list) and len(received) == len(states), "tapes differ by rank"
    count = len(tape.generators)
    devices = [device for device, _ in tape.generators]
    tape.generators = list(zip(devices, received[:count], strict=True))
    for op, state in zip(reseeded, received[count:], strict=True):
        op.reseed = state


def replay_tensors(
    tensors: Sequence[torch.Tensor],
    receive: Callable[[int, torch.Tensor], None],
    group: dist.ProcessGroup | None = None,
    src: int = 0,
) -> None:
    """Compute lazy ``tensors`` and call ``receive(index, value)`` for each, in construction
    order; ``value`` is the full real tensor, valid only during the call (copy what you keep).

    With a process group, every rank draws the random numbers of global rank ``src``
    (COLLECTIVE: every rank of ``group`` calls it with the same model).

    Raises:
        ValueError: a tensor is not lazy, or the tensors come from different contexts.
    """
    tapes = {id(r.tape): r.tape for t in tensors if (r := lazy_storage(t)) is not None}
    if len(tapes) > 1:
        raise ValueError("replay_tensors: the tensors come from different LazyInitContexts.")
    if not tapes:
        if tensors:
            raise ValueError("replay_tensors: none of the tensors is lazy.")
        return
    tape = next(iter(tapes.values()))
    by_key: dict[int, list[tuple[int, torch.Tensor]]] = {}
    for index, tensor in enumerate(tensors):
        record = lazy_storage(tensor)
        if record is None:
            raise ValueError(f"replay_tensors: tensor {index} is not lazy.")
        by_key.setdefault(record.key, []).append((index, tensor))
    sync_generators(tape, group, src)

    def sink_for(key: int) -> Sink:
        def sink(storage: torch.UntypedStorage) -> None:
            for index, tensor in by_key[key]:
                receive(index, view_of(storage, ref_of(tensor, key)))

        return sink

    replay(tape, {key: sink_for(key) for key in by_key})


def swap_in(old: torch.Tensor, value: torch.Tensor) -> None:
    """Make the object ``old`` hold ``value``: the same Python object (an optimizer or a tied
    module still holds it), with its attributes, now a real tensor."""
    new: torch.Tensor
    if isinstance(old, nn.Parameter):
        new = nn.Parameter(value, requires_grad=old.requires_grad)
    else:
        new = value.detach().requires_grad_(old.requires_grad)
    new.__dict__.update(old.__dict__)
    torch.utils.swap_tensors(old, new)


def _keep_all(name: str, lazy: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    return full.clone()


def materialize_module(
    module: nn.Module,
    keep: Keep | None = None,
    group: dist.ProcessGroup | None = None,
    src: int = 0,
) -> int:
    """Give every lazy parameter and buffer of ``module`` its real value, in place.

    Args:
        module: a model built (partly) inside a LazyInitContext.
        keep: what to keep of each full value (default: all of it); it must return a new
            tensor (not a view of the value it gets).
        group: ranks that must agree (COLLECTIVE over it): they all use ``src``'s random states.
        src: the global rank whose random states are used.

    Returns:
        The number of elements materialised on this rank.
    """
    named = list(lazy_named_tensors(module))
    keep = keep or _keep_all
    kept: dict[int, torch.Tensor] = {}

    def receive(index: int, full: torch.Tensor) -> None:
        name, lazy = named[index]
        kept[index] = keep(name, lazy, full)

    if module_tape(module) is None:
        return 0
    replay_tensors([t for _, t in named], receive, group, src)
    for index, (_, tensor) in enumerate(named):
        swap_in(tensor, kept[index])
    return sum(t.numel() for t in kept.values())


def materialize_on(
    module: nn.Module, device: torch.device | str, group: dist.ProcessGroup | None = None
) -> None:
    """Materialise every lazy tensor of ``module`` whole, straight onto ``device`` (what a plugin
    that keeps full parameters does; COLLECTIVE over ``group`` when ``module`` is lazy: every
    rank uses rank 0's random states). No-op for an eager module.

    Raises:
        ValueError: see :meth:`~kolossos.lazy.LazyInitContext.materialize`.
    """
    if module_tape(module) is None:
        return
    target = torch.device(device)

    def keep(name: str, lazy: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        return full.to(target, copy=True)

    materialize_module(module, keep, group)
