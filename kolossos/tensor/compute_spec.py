"""``ComputeSpec``: how a ColoParameter takes part in computation (its tensor-parallel pattern)
and whether the outputs of the operators it feeds are made replicated again.

Example:
    >>> spec = ComputeSpec(ComputePattern.TP1D)
    >>> spec.set_output_replicate(False)
    >>> spec.output_replicate
    False
"""

from __future__ import annotations

from enum import Enum

__all__ = ["ComputePattern", "ComputeSpec"]


class ComputePattern(Enum):
    """The tensor-parallel pattern of a parameter (only ``TP1D`` is computed on)."""

    TP1D = 0
    TP2D = 1
    TP2P5D = 2
    TP3D = 3


class ComputeSpec:
    """The compute pattern of a parameter plus its output rule.

    Args:
        compute_pattern: the pattern; operators on the parameter are computed sharded.

    Raises:
        TypeError: ``compute_pattern`` is not a :class:`ComputePattern`.
        NotImplementedError: a pattern other than ``TP1D``.
    """

    def __init__(self, compute_pattern: ComputePattern) -> None:
        if not isinstance(compute_pattern, ComputePattern):
            raise TypeError(f"ComputeSpec({compute_pattern!r}): pass a ComputePattern, e.g. TP1D.")
        if compute_pattern is not ComputePattern.TP1D:
            raise NotImplementedError(
                f"ComputeSpec({compute_pattern}): only ComputePattern.TP1D is supported; use "
                "kolossos.nn.layer (2D/2.5D/3D layers) for the other modes."
            )
        self.compute_pattern = compute_pattern
        #: make the outputs of operators on this parameter replicated over the tp group
        self.output_replicate = True

    def set_output_replicate(self, flag: bool = True) -> None:
        """Keep (``False``) or gather (``True``, default) the sharded outputs of its operators."""
        self.output_replicate = bool(flag)

    def __repr__(self) -> str:
        return (
            f"ComputeSpec(pattern={self.compute_pattern}, replicate_output={self.output_replicate})"
        )
