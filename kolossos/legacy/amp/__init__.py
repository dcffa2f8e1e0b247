"""Colossal-AI's legacy AMP API (``colossalai.amp``): :class:`AMP_TYPE` and
:func:`convert_to_amp`, carried out by the Booster's mixed-precision recipes. Also reachable as
``kolossos.amp.AMP_TYPE`` / ``kolossos.amp.convert_to_amp`` (resolved lazily). See
``docs/legacy.md``.

Example:
    >>> from kolossos.legacy.amp import AMP_TYPE
    >>> fp16 = dict(mode=AMP_TYPE.TORCH, init_scale=2**12)  # a config key for initialize
"""

from kolossos.legacy.amp.amp_type import AMP_TYPE
from kolossos.legacy.amp.convert import (
    convert_to_amp,
    convert_to_apex_amp,
    convert_to_naive_amp,
    convert_to_torch_amp,
)

__all__ = [
    "AMP_TYPE",
    "convert_to_amp",
    "convert_to_apex_amp",
    "convert_to_naive_amp",
    "convert_to_torch_amp",
]
