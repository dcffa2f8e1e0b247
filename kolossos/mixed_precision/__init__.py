"""Alias of :mod:`kolossos.booster.mixed_precision` (the docs import from both paths)."""

from kolossos.booster.mixed_precision import (
    PRECISIONS,
    BF16MixedPrecision,
    FP16ApexMixedPrecision,
    FP16NaiveMixedPrecision,
    FP16TorchMixedPrecision,
    MixedPrecision,
    mixed_precision_factory,
)

__all__ = [
    "PRECISIONS",
    "BF16MixedPrecision",
    "FP16ApexMixedPrecision",
    "FP16NaiveMixedPrecision",
    "FP16TorchMixedPrecision",
    "MixedPrecision",
    "mixed_precision_factory",
]
