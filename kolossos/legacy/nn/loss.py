"""Colossal-AI's losses (``colossalai.legacy.nn.loss``): ``CrossEntropyLoss`` follows the launch
config's tensor parallelism; it lives with the other config-driven layers in
:mod:`kolossos.legacy.layers` (also ``kolossos.nn.CrossEntropyLoss``)."""

from kolossos.legacy.layers import CrossEntropyLoss

__all__ = ["CrossEntropyLoss"]
