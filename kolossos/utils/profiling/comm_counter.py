"""Count what collectives a process runs: calls and bytes per collective kind and process group.

:class:`CommCounter` is a context manager holding a ``TorchDispatchMode``. Every collective of
``torch.distributed`` reaches the dispatcher as a ``c10d`` operator — whether it was called from
Python (``dist.all_reduce``, FSDP2's all-gathers) or from C++ through a ``ProcessGroup`` (DDP's
reducer, which never passes through the Python functions) — and functional collectives as
``_c10d_functional`` operators, so one mechanism sees them all, on gloo and NCCL alike, without
patching ``torch.distributed`` or registering DDP comm hooks. The counter costs a Python call per
operator while active: use it for accounting passes, not for timing.

:class:`WireMeter` measures, independently of any model, the bytes the process actually wrote to
its sockets (``/proc/self/io``), which for gloo's TCP transport is what it sent.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kolossos.utils.profiling._collective_ops import NAMESPACES, Record, records_of
from kolossos.utils.profiling.estimators import collective_sent_bytes

__all__ = ["CollectiveStats", "CommCounter", "WireMeter"]


@dataclass
class CollectiveStats:
    """Totals for one (kind, group) pair."""

    calls: int = 0
    """number of calls"""
    bytes: int = 0
    """logical bytes (see :class:`CommCounter`)"""
    sent_bytes: float = 0.0
    """bytes this rank sends under the counter's algorithm model"""
    group_size: int = 1
    """ranks in the group"""
    backend: str = "unknown"
    """the group's backend (``gloo``, ``nccl``)"""


def _describe(group: Any) -> tuple[str, int, str]:
    """(label, size, backend) of a process group; the label is ``world`` or ``ranks=a,b,...``."""
    import torch.distributed as dist

    if group is None:
        return "unknown", 1, "unknown"
    try:
        backend = str(dist.get_backend(group))
    except (RuntimeError, ValueError):
        backend = "unknown"
    if dist.is_initialized() and group == dist.group.WORLD:
        return "world", group.size(), backend
    try:
        ranks = dist.get_process_group_ranks(group)
    except (RuntimeError, ValueError):  # a group the Python world does not know
        return f"group:{group.group_name}", group.size(), backend
    return "ranks=" + ",".join(map(str, ranks)), group.size(), backend


def _is_dtensor_type(cls: type) -> bool:
    if cls is torch.Tensor or cls is torch.nn.Parameter:
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch build without distributed tensors
        return False
    return issubclass(cls, DTensor)


class _CountingMode(TorchDispatchMode):
    def __init__(self, counter: CommCounter) -> None:
        super().__init__()
        self._counter = counter

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        # DTensor must run first: it desugars into plain-tensor operators and collectives (its
        # redistributions), which then come back here. Returning NotImplemented lets it do so.
        if any(_is_dtensor_type(t) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        if func.namespace in NAMESPACES:
            for record in records_of(func, args, kwargs):
                self._counter._add(record)
        return func(*args, **kwargs)


class CommCounter:
    """Count collective calls and bytes per kind (``all_reduce``, ``reduce_scatter``, ...) and per
    process group, while the context is active.

    ``bytes`` is the logical size of each collective: the tensor of an all-reduce or broadcast,
    the whole input of a reduce-scatter or all-to-all, the gathered output of an all-gather, the
    tensors of a send or receive. ``sent_bytes`` is what this rank puts on the wire under an
    algorithm model (:func:`~kolossos.utils.profiling.estimators.collective_sent_bytes`):
    ``"ring"`` (bandwidth-optimal, NCCL), ``"gloo"`` (torch's gloo backend as measured; its
    reduce-scatter costs a full all-reduce), or ``"auto"``, which picks by each group's backend.

    Counted: every ``c10d`` and ``_c10d_functional`` operator run by this thread or by autograd's
    backward (DDP's reducer included), and DTensor's redistributions (DTensor is let run first, so
    its collectives come back through the counter). Not seen: collectives that another tensor
    subclass issues inside its own ``__torch_dispatch__``, and threads that do not inherit the mode.

    Args:
        algorithm: ``"auto"``, ``"ring"`` or ``"gloo"``.

    Example:
        >>> with CommCounter() as comm:
        ...     dist.all_reduce(torch.ones(1024))          # doctest: +SKIP
        >>> comm.bytes("all_reduce"), comm.calls()          # doctest: +SKIP
        (4096, 1)
        >>> print(comm.summary())                           # doctest: +SKIP
    """

    def __init__(self, algorithm: str = "auto") -> None:
        if algorithm not in ("auto", "ring", "gloo"):
            raise ValueError(f"algorithm={algorithm!r} must be 'auto', 'ring' or 'gloo'.")
        self.algorithm = algorithm
        self._stats: dict[tuple[str, str], CollectiveStats] = {}
        self._lock = threading.Lock()
        self._mode: _CountingMode | None = None
        self._labels: dict[str, tuple[str, int, str]] = {}  # by group name

    # ------------------------------------------------------------------ recording
    def _add(self, record: Record) -> None:
        key = "" if record.group is None else str(record.group.group_name)
        described = self._labels.get(key)
        if described is None:
            described = self._labels[key] = _describe(record.group)
        label, size, backend = described
        algorithm = self.algorithm
        if algorithm == "auto":
            algorithm = "gloo" if backend == "gloo" else "ring"
        sent = collective_sent_bytes(record.kind, record.nbytes, max(size, 1), algorithm)
        with self._lock:
            stats = self._stats.setdefault(
                (record.kind, label), CollectiveStats(group_size=size, backend=backend)
            )
            stats.calls += 1
            stats.bytes += record.nbytes
            stats.sent_bytes += sent

    def reset(self) -> None:
        """Forget everything counted so far."""
        with self._lock:
            self._stats.clear()

    def __enter__(self) -> CommCounter:
        if self._mode is not None:
            raise RuntimeError("this CommCounter is already active; use a new one to nest.")
        self._labels.clear()  # group objects may have been destroyed since the last use
        self._mode = _CountingMode(self)
        self._mode.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        assert self._mode is not None
        mode, self._mode = self._mode, None
        mode.__exit__(exc_type, exc, traceback)

    # ------------------------------------------------------------------ results
    @property
    def stats(self) -> dict[tuple[str, str], CollectiveStats]:
        """A copy of the totals keyed by ``(kind, group label)``."""
        with self._lock:
            return {k: CollectiveStats(**vars(v)) for k, v in self._stats.items()}

    def _select(self, kind: str | None, group: str | None) -> list[CollectiveStats]:
        return [
            s
            for (k, g), s in self.stats.items()
            if (kind is None or k == kind) and (group is None or g == group)
        ]

    def calls(self, kind: str | None = None, group: str | None = None) -> int:
        """Number of calls, of one kind and/or group label, or of all."""
        return sum(s.calls for s in self._select(kind, group))

    def bytes(self, kind: str | None = None, group: str | None = None) -> int:
        """Logical bytes, of one kind and/or group label, or of all."""
        return sum(s.bytes for s in self._select(kind, group))

    def sent_bytes(self, kind: str | None = None, group: str | None = None) -> float:
        """Modelled bytes this rank sent, of one kind and/or group label, or of all."""
        return sum(s.sent_bytes for s in self._select(kind, group))

    def as_dict(self) -> dict[str, dict[str, dict[str, Any]]]:
        """``{group: {kind: {calls, bytes, sent_bytes, group_size, backend}}}``, JSON-ready."""
        out: dict[str, dict[str, dict[str, Any]]] = {}
        for (kind, group), s in sorted(self.stats.items()):
            out.setdefault(group, {})[kind] = dict(vars(s))
        return out

    def summary(self) -> str:
        """A small table: one line per (group, kind) with calls, MiB and modelled MiB sent."""
        lines = [f"{'group':<16} {'kind':<15} {'calls':>7} {'MiB':>11} {'sent MiB':>11}"]
        for (kind, group), s in sorted(self.stats.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            lines.append(
                f"{group:<16} {kind:<15} {s.calls:>7} {s.bytes / 2**20:>11.3f} "
                f"{s.sent_bytes / 2**20:>11.3f}"
            )
        return "\n".join(lines)


def _written_bytes() -> int | None:
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class WireMeter:
    """Bytes this process wrote through ``write``-family system calls while active (Linux).

    gloo's TCP transport sends with ``writev``, so on gloo this is what the process really sent
    to its peers (all threads), plus whatever else it wrote meanwhile (logs, files): keep the
    block free of other output. NCCL traffic does not pass through such calls and is not seen.
    ``bytes`` is ``None`` where ``/proc/self/io`` cannot be read.

    Example:
        >>> with WireMeter() as wire:
        ...     dist.all_reduce(torch.ones(2**20))  # doctest: +SKIP
        >>> wire.bytes  # about 2(N-1)/N · 4 MiB          # doctest: +SKIP
    """

    def __init__(self) -> None:
        self._start: int | None = None
        self.bytes: int | None = None

    @staticmethod
    def available() -> bool:
        """Whether the write counter can be read here."""
        return _written_bytes() is not None

    def __enter__(self) -> WireMeter:
        self._start = _written_bytes()
        self.bytes = None
        return self

    def __exit__(self, *exc: object) -> None:
        end = _written_bytes()
        self.bytes = None if end is None or self._start is None else end - self._start
