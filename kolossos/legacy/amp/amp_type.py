"""``AMP_TYPE``: the three mixed-precision modes of the legacy ``fp16`` config key."""

from __future__ import annotations

from enum import Enum
from typing import Any

__all__ = ["AMP_TYPE", "parse_amp_mode"]


class AMP_TYPE(str, Enum):
    """The ``mode`` of ``fp16=dict(mode=..., **kwargs)`` (and of :func:`convert_to_amp`).

    - ``TORCH``: autocast to fp16, fp32 parameters, dynamic loss scale (``torch.amp`` style);
    - ``NAIVE``: the whole model in fp16 with fp32 master weights (apex O2 style);
    - ``APEX``: apex's options, carried out by one of the two recipes above (apex itself is not
      used; a warning says which recipe runs).

    Example:
        >>> AMP_TYPE("torch") is AMP_TYPE.TORCH
        True
    """

    APEX = "apex"
    TORCH = "torch"
    NAIVE = "naive"


def parse_amp_mode(mode: Any) -> AMP_TYPE:
    """``mode`` as an :class:`AMP_TYPE` (a member or its value, ``"torch"`` etc.).

    Raises:
        ValueError: anything else, naming the accepted values.
    """
    if isinstance(mode, AMP_TYPE):
        return mode
    if isinstance(mode, str) and mode.lower() in {m.value for m in AMP_TYPE}:
        return AMP_TYPE(mode.lower())
    accepted = ", ".join(f"AMP_TYPE.{m.name}" for m in AMP_TYPE)
    raise ValueError(
        f"fp16 mode={mode!r} is not an AMP mode; use one of {accepted} "
        "(from kolossos.amp import AMP_TYPE), or leave the fp16 key out for fp32 training."
    )
