"""Which tensor-parallel layouts ``N`` processes allow, and which of them a benchmark's sizes fit.

Pure arithmetic, no process group and no torch: the command checks everything here before it
starts a process. The enumeration follows Colossal-AI's ``colossalai benchmark``: data parallel
only, ``1d`` over all ``N`` ranks, ``2d`` when ``N`` is a square ``q*q`` (``q >= 2``), ``2.5d``
for every depth ``d < N`` that leaves a square ``N / d = q*q`` (``q >= 2``), and ``3d`` when ``N``
is a cube ``q*q*q`` (``q >= 2``).

Example:
    >>> [layout.name for layout in enumerate_layouts(8)]
    ['data', '1d', '2.5d-depth2', '3d']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Layout", "Sizes", "enumerate_layouts", "integer_root", "skip_reason"]


def integer_root(value: int, power: int) -> int | None:
    """The integer ``r >= 2`` with ``r**power == value``, else ``None``.

    Example:
        >>> integer_root(16, 2), integer_root(8, 3), integer_root(8, 2), integer_root(1, 2)
        (4, 2, None, None)
    """
    if value < 2:
        return None
    root = round(value ** (1.0 / power))
    for candidate in (root - 1, root, root + 1):  # float roots can be one off
        if candidate >= 2 and candidate**power == value:
            return candidate
    return None


@dataclass(frozen=True, kw_only=True)
class Layout:
    """One way to lay ``nproc`` ranks out for the benchmark MLP."""

    mode: str | None
    """``None`` (data parallel only), ``"1d"``, ``"2d"``, ``"2.5d"`` or ``"3d"``."""
    nproc: int
    """Processes in the job (the tensor-parallel size of every mode but ``None``)."""
    q: int = 1
    """The grid edge: ``q`` of a ``q*q`` (2D), ``q*q*d`` (2.5D) or ``q*q*q`` (3D) grid."""
    depth: int = 1
    """The 2.5D depth ``d``."""

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ValueError(f"Layout: nproc={self.nproc} must be at least 1.")
        expected = {
            None: self.nproc,
            "1d": self.nproc,
            "2d": self.q**2,
            "2.5d": self.q**2 * self.depth,
            "3d": self.q**3,
        }
        if self.mode not in expected:
            raise ValueError(f"Layout: mode={self.mode!r} must be None, 1d, 2d, 2.5d or 3d.")
        if expected[self.mode] != self.nproc:
            raise ValueError(f"Layout: mode {self.mode} with q={self.q}, depth={self.depth} "
                             f"does not hold {self.nproc} ranks.")  # fmt: skip

    @property
    def name(self) -> str:
        """A short key: ``data``, ``1d``, ``2d``, ``2.5d-depth2``, ``3d``."""
        if self.mode is None:
            return "data"
        return f"2.5d-depth{self.depth}" if self.mode == "2.5d" else self.mode

    @property
    def label(self) -> str:
        """The table's name: ``data parallel``, ``1d``, ``2d``, ``2.5d (depth 2)``, ``3d``."""
        if self.mode is None:
            return "data parallel"
        return f"2.5d (depth {self.depth})" if self.mode == "2.5d" else self.mode

    @property
    def grid(self) -> str:
        """How the ranks are arranged: ``dp=4``, ``4``, ``2x2``, ``2x2x2`` (q x q x d)."""
        if self.mode is None:
            return f"dp={self.nproc}"
        if self.mode == "1d":
            return str(self.nproc)
        if self.mode == "2d":
            return f"{self.q}x{self.q}"
        third = self.depth if self.mode == "2.5d" else self.q
        return f"{self.q}x{self.q}x{third}"

    def parallel_config(self) -> dict[str, Any]:
        """The ``parallel`` entry of the launch config that builds this layout's groups."""
        if self.mode is None:
            return {"data": self.nproc}
        tensor: dict[str, Any] = {"size": self.nproc, "mode": self.mode}
        if self.mode == "2.5d":
            tensor["depth"] = self.depth
        return {"tensor": tensor}

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready description (what the worker receives and the report prints)."""
        return {"name": self.name, "label": self.label, "grid": self.grid, "mode": self.mode,
                "nproc": self.nproc, "q": self.q, "depth": self.depth}  # fmt: skip

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Layout:
        """The layout :meth:`as_dict` described."""
        return cls(mode=data["mode"], nproc=data["nproc"], q=data["q"], depth=data["depth"])


def enumerate_layouts(nproc: int) -> list[Layout]:
    """Every layout ``nproc`` ranks allow, in the order Colossal-AI lists them.

    Raises:
        ValueError: ``nproc < 1``.

    Example:
        >>> [layout.grid for layout in enumerate_layouts(16)]
        ['dp=16', '16', '4x4', '4x4x1', '2x2x4']
    """
    if nproc < 1:
        raise ValueError(f"nproc={nproc} must be at least 1 (the number of processes).")
    layouts = [Layout(mode=None, nproc=nproc), Layout(mode="1d", nproc=nproc)]
    square = integer_root(nproc, 2)
    if square is not None:
        layouts.append(Layout(mode="2d", nproc=nproc, q=square))
    for depth in range(1, nproc):
        q = integer_root(nproc // depth, 2) if nproc % depth == 0 else None
        if q is not None:
            layouts.append(Layout(mode="2.5d", nproc=nproc, q=q, depth=depth))
    cube = integer_root(nproc, 3)
    if cube is not None:
        layouts.append(Layout(mode="3d", nproc=nproc, q=cube))
    return layouts


@dataclass(frozen=True, kw_only=True)
class Sizes:
    """The benchmark input ``(batch_size, seq_len, dimension)``."""

    batch_size: int
    """Samples per step (the global batch)."""
    dimension: int
    """Hidden size of every ``Linear(dimension, dimension)``."""


def _multiple(value: int, by: int, what: str, why: str) -> str | None:
    if value % by == 0:
        return None
    return f"{what} {value} is not a multiple of {by} ({why})"


def skip_reason(layout: Layout, sizes: Sizes) -> str | None:
    """Why ``layout`` cannot run on ``sizes`` (a sentence naming the value and the rule), or
    ``None`` when it can.

    The rules are those of the layers and split helpers: data parallel splits the batch over
    the ranks; 1D splits the hidden size over them; 2D splits the batch by ``q`` and the hidden
    size by ``q*q`` (the bias); 2.5D splits the batch by ``d*q`` and the hidden size by ``q``;
    3D splits the batch by ``q*q`` and the hidden size by ``q*q``.

    Example:
        >>> skip_reason(Layout(mode="2d", nproc=4, q=2), Sizes(batch_size=8, dimension=18))
        '--dimension 18 is not a multiple of 4 (2D splits the hidden size by q*q = 4)'
    """
    b, h, q, d = sizes.batch_size, sizes.dimension, layout.q, layout.depth
    n = layout.nproc
    rules: dict[str | None, list[tuple[int, int, str, str]]] = {
        None: [(b, n, "--batch_size", f"data parallel splits the batch over {n} ranks")],
        "1d": [(h, n, "--dimension", f"1D splits the hidden size over {n} ranks")],
        "2d": [
            (b, q, "--batch_size", f"2D splits the batch by q = {q}"),
            (h, q * q, "--dimension", f"2D splits the hidden size by q*q = {q * q}"),
        ],
        "2.5d": [
            (b, d * q, "--batch_size", f"2.5D splits the batch by depth*q = {d * q}"),
            (h, q, "--dimension", f"2.5D splits the hidden size by q = {q}"),
        ],
        "3d": [
            (b, q * q, "--batch_size", f"3D splits the batch by q*q = {q * q}"),
            (h, q * q, "--dimension", f"3D splits the hidden size by q*q = {q * q}"),
        ],
    }
    for value, by, what, why in rules[layout.mode]:
        reason = _multiple(value, by, what, why)
        if reason is not None:
            return reason
    return None
