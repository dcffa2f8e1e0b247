"""``LossScalePolicy``: how the fp16 loss scale starts, grows and backs off — one object that
every plugin, engine config and optimizer takes.

Colossal-AI spells the policy as seven keywords on each plugin and ZeRO optimizer (with
different defaults per class); kolossos keeps those public keywords and groups them here once, so
validation, defaults and the scaler built from them have a single home.

Example:
    >>> policy = LossScalePolicy(initial_scale=2**8, growth_interval=100)
    >>> policy.initial_scale, policy.hysteresis
    (256, 2)
    >>> arguments = {"initial_scale": 8.0, "lr": 0.1}
    >>> LossScalePolicy.take(arguments).initial_scale, arguments
    (8.0, {'lr': 0.1})
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["LOSS_SCALE_KEYWORDS", "LossScalePolicy", "check_count", "check_positive_finite"]

#: the public keywords (Colossal-AI's names) that make up a policy, in signature order
LOSS_SCALE_KEYWORDS = (
    "initial_scale",
    "min_scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "hysteresis",
    "max_scale",
)


def check_positive_finite(name: str, value: Any) -> float:
    """``value`` as a float.

    Raises:
        TypeError: not a number.
        ValueError: not finite, or not > 0.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__}).")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"{name}={value!r} is invalid: it must be a finite number > 0. "
            f"Pass e.g. {name}=2**16 for a loss scale."
        )
    return float(value)


def check_count(name: str, value: Any) -> int:
    """``value`` as an int >= 1.

    Raises:
        TypeError: not an int.
        ValueError: below 1.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__}).")
    if value < 1:
        raise ValueError(f"{name}={value} is invalid: it must be >= 1. Pass {name}=1 or more.")
    return value


@dataclass(frozen=True, kw_only=True)
class LossScalePolicy:
    """The dynamic fp16 loss-scale policy (see :class:`kolossos.amp.DynamicGradScaler` for the
    semantics of each step). Validated on construction, before any collective.

    Raises:
        TypeError / ValueError: a field breaks the rule in its description (named).
    """

    initial_scale: float = 2**16
    """The scale to start with; ``min_scale <= initial_scale <= max_scale``."""
    min_scale: float = 1
    """The floor of the scale (> 0)."""
    growth_factor: float = 2
    """The factor applied after ``growth_interval`` good steps (> 1)."""
    backoff_factor: float = 0.5
    """The factor applied on a backoff (strictly between 0 and 1)."""
    growth_interval: int = 1000
    """Consecutive good steps needed to grow (>= 1)."""
    hysteresis: int = 2
    """Overflows since the last growth at which backoff starts (>= 1)."""
    max_scale: float = 2**32
    """The cap of the scale (finite)."""

    def __post_init__(self) -> None:
        scale = check_positive_finite("initial_scale", self.initial_scale)
        low = check_positive_finite("min_scale", self.min_scale)
        high = check_positive_finite("max_scale", self.max_scale)
        growth = check_positive_finite("growth_factor", self.growth_factor)
        backoff = check_positive_finite("backoff_factor", self.backoff_factor)
        check_count("growth_interval", self.growth_interval)
        check_count("hysteresis", self.hysteresis)
        if not low <= scale <= high:
            raise ValueError(
                f"initial_scale={self.initial_scale!r} must satisfy min_scale <= initial_scale "
                f"<= max_scale (min_scale={self.min_scale!r}, max_scale={self.max_scale!r}); "
                "choose an initial_scale inside that range or widen it."
            )
        if growth <= 1:
            raise ValueError(
                f"growth_factor={self.growth_factor!r} must be > 1 so that the scale can grow; "
                "pass e.g. growth_factor=2."
            )
        if backoff >= 1:
            raise ValueError(
                f"backoff_factor={self.backoff_factor!r} must satisfy 0 < backoff_factor < 1 so "
                "that an overflow lowers the scale; pass e.g. backoff_factor=0.5."
            )

    def as_kwargs(self) -> dict[str, Any]:
        """The policy as the seven public keywords (for APIs that take them one by one)."""
        return asdict(self)

    @classmethod
    def of(cls, arguments: Mapping[str, Any]) -> LossScalePolicy:
        """The policy described by the loss-scale keywords present in ``arguments`` (e.g. a
        constructor's ``locals()``); missing ones take the policy's defaults."""
        return cls(**{name: arguments[name] for name in LOSS_SCALE_KEYWORDS if name in arguments})

    @classmethod
    def take(cls, arguments: dict[str, Any]) -> LossScalePolicy:
        """Remove the loss-scale keywords present in ``arguments`` (in place) and return the
        policy they describe (missing ones take the policy's defaults)."""
        given = {name: arguments.pop(name) for name in LOSS_SCALE_KEYWORDS if name in arguments}
        return cls(**given)
