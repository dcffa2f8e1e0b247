"""Mixed-precision recipes for the Booster: ``'fp16'``, ``'fp16_naive'``, ``'fp16_apex'``,
``'bf16'``, ``'fp32'`` or one of the classes below.

Example:
    >>> booster = Booster(mixed_precision="fp16", plugin=TorchDDPPlugin())
    >>> booster = Booster(mixed_precision=FP16TorchMixedPrecision(init_scale=2**10))
"""

from __future__ import annotations

from kolossos.booster.mixed_precision.bf16 import BF16MixedPrecision
from kolossos.booster.mixed_precision.fp16_apex import FP16ApexMixedPrecision
from kolossos.booster.mixed_precision.fp16_naive import FP16NaiveMixedPrecision
from kolossos.booster.mixed_precision.fp16_torch import FP16TorchMixedPrecision
from kolossos.booster.mixed_precision.mixed_precision_base import MixedPrecision

_FACTORY: dict[str, type[MixedPrecision]] = {
    "fp16": FP16TorchMixedPrecision,
    "fp16_naive": FP16NaiveMixedPrecision,
    "fp16_apex": FP16ApexMixedPrecision,
    "bf16": BF16MixedPrecision,
}
PRECISIONS = (*_FACTORY, "fp32")


def mixed_precision_factory(name: str) -> MixedPrecision | None:
    """The recipe for a precision name (``None`` for ``'fp32'``).

    Raises:
        ValueError: an unknown name (``'fp8'`` included: there is no fp8 recipe).
    """
    if name == "fp32":
        return None
    if name not in _FACTORY:
        raise ValueError(
            f"mixed_precision={name!r} is not supported; use one of {', '.join(PRECISIONS)}, "
            "or pass a MixedPrecision object."
        )
    return _FACTORY[name]()


__all__ = [
    "PRECISIONS",
    "BF16MixedPrecision",
    "FP16ApexMixedPrecision",
    "FP16NaiveMixedPrecision",
    "FP16TorchMixedPrecision",
    "MixedPrecision",
    "mixed_precision_factory",
]
