"""Loss scalers for fp16 training: :class:`DynamicGradScaler` and :class:`ConstantGradScaler`.

One implementation shared by the Booster's fp16 mixed precision, LowLevelZero and Gemini. A scaler
only decides the scale; multiplying the loss, unscaling the gradients and detecting overflow live in
:mod:`kolossos.amp.overflow`, and skipping the optimizer step on overflow is the caller's job.

The scale is kept as a Python float on the host, so reading it never synchronises with a device.
"""

from __future__ import annotations

import enum
import logging
from abc import ABC, abstractmethod
from typing import Any

import torch

from kolossos.amp.loss_scale import LossScalePolicy, check_positive_finite

__all__ = ["BaseGradScaler", "ConstantGradScaler", "DynamicGradScaler", "ScaleEvent"]

_logger = logging.getLogger(__name__)
_HYPER_PARAMETERS = "min_scale max_scale growth_factor backoff_factor growth_interval hysteresis"


class ScaleEvent(enum.Enum):
    """What one :meth:`BaseGradScaler.update` call did (returned for logging and tests)."""

    GOOD = "good"
    """A step without overflow that did not complete a growth interval; the scale is unchanged."""
    GROW = "grow"
    """A growth interval completed: the scale was multiplied by ``growth_factor`` (capped)."""
    TOLERATE = "tolerate"
    """An overflow absorbed by the hysteresis budget; the scale is unchanged."""
    BACKOFF = "backoff"
    """An overflow that multiplied the scale by ``backoff_factor`` (floored at ``min_scale``)."""
    SKIP = "skip"
    """An overflow seen by a :class:`ConstantGradScaler`; the scale never changes."""


class BaseGradScaler(ABC):
    """The interface every loss scaler implements.

    Args:
        initial_scale: the loss scale to start with (finite, > 0).
        verbose: log every change of the scale at INFO level.
    """

    def __init__(self, initial_scale: float, verbose: bool = False) -> None:
        self._scale = check_positive_finite("initial_scale", initial_scale)
        self.verbose = bool(verbose)

    @property
    def scale(self) -> float:
        """The current loss scale (a Python float: reading it never syncs a device)."""
        return self._scale

    @property
    def inv_scale(self) -> float:
        """``1 / scale``: the factor that unscales gradients."""
        return 1.0 / self._scale

    def scale_tensor(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The scale as a 0-dim float32 tensor on ``device`` (CPU when ``None``)."""
        return torch.tensor(self._scale, dtype=torch.float32, device=device)

    @abstractmethod
    def update(self, found_inf: bool) -> ScaleEvent:
        """Advance the scaler by one optimizer step.

        Args:
            found_inf: whether any rank's gradients held inf or NaN this step (see
                :func:`kolossos.amp.all_reduce_overflow`). A 0-dim tensor is accepted too, at the
                cost of a host sync.

        Returns:
            What happened to the scale.
        """

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The state needed to resume (plain Python numbers)."""

    @abstractmethod
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the state returned by :meth:`state_dict`."""

    def _load_scale(self, state_dict: dict[str, Any]) -> float:
        if "scale" not in state_dict:
            raise KeyError(
                f"loss-scaler state dict has no 'scale' entry (keys: {sorted(state_dict)}); "
                "pass the dict returned by state_dict()."
            )
        value = state_dict["scale"]
        scale = float(value.item() if isinstance(value, torch.Tensor) else value)
        return check_positive_finite("state_dict['scale']", scale)


class ConstantGradScaler(BaseGradScaler):
    """A loss scaler whose scale never changes; steps with overflow are still reported as skipped.

    Args:
        scale: the fixed loss scale (finite, > 0).
        verbose: log skipped steps at INFO level.

    Example:
        >>> scaler = ConstantGradScaler(128.0)
        >>> scaler.update(found_inf=True)
        <ScaleEvent.SKIP: 'skip'>
        >>> scaler.scale
        128.0
    """

    def __init__(self, scale: float, verbose: bool = False) -> None:
        super().__init__(scale, verbose)

    def update(self, found_inf: bool) -> ScaleEvent:
        if bool(found_inf):
            if self.verbose:
                _logger.info("overflow: step skipped, constant loss scale %g kept", self._scale)
            return ScaleEvent.SKIP
        return ScaleEvent.GOOD

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self._scale}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._scale = self._load_scale(state_dict)


class DynamicGradScaler(BaseGradScaler):
    """A loss scaler that backs off on overflow and grows after a run of good steps.

    Semantics of :meth:`update` (the same as Colossal-AI's and Megatron-LM's scalers):

    - **Overflow step.** The growth tracker is reset to 0 and the hysteresis budget (which starts
      at ``hysteresis``) is decremented. If the budget has reached 0, the scale is multiplied by
      ``backoff_factor`` and floored at ``min_scale``; otherwise the scale is kept.
    - **Good step.** The growth tracker is incremented. When it reaches ``growth_interval``, the
      scale is multiplied by ``growth_factor`` and capped at ``max_scale``, the growth tracker is
      reset to 0 and the hysteresis budget is refilled to ``hysteresis``.

    So ``hysteresis=h`` means: counting the overflows since the last growth (or since the start),
    the first ``h - 1`` are tolerated (the step is skipped, the scale kept) and the ``h``-th and
    every later one back off. Good steps in between do **not** refill the budget, only a growth
    does, so the overflows need not be consecutive. With ``hysteresis=1`` every overflow backs
    off; with the default ``hysteresis=2`` the first overflow after a growth is tolerated and the
    second backs off. Every overflow step should be skipped by the caller whatever the scaler did.

    Args:
        initial_scale: the scale to start with; ``min_scale <= initial_scale <= max_scale``.
        min_scale: the floor of the scale (> 0).
        growth_factor: the factor applied on growth (> 1).
        backoff_factor: the factor applied on backoff (strictly between 0 and 1).
        growth_interval: consecutive good steps needed to grow (>= 1).
        hysteresis: overflows since the last growth at which backoff starts (>= 1).
        max_scale: the cap of the scale (finite).
        verbose: log every change of the scale at INFO level.

    Raises:
        ValueError: an argument breaks the rule stated above.
        TypeError: an argument is not a number (or not an int for the two counts).

    Example:
        >>> scaler = DynamicGradScaler(initial_scale=8, growth_interval=2, hysteresis=1)
        >>> [scaler.update(False).value, scaler.update(False).value, scaler.scale]
        ['good', 'grow', 16.0]
        >>> scaler.update(True).value, scaler.scale
        ('backoff', 8.0)
    """

    def __init__(
        self,
        initial_scale: float = 2**16,
        min_scale: float = 1,
        growth_factor: float = 2,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        max_scale: float = 2**32,
        verbose: bool = False,
    ) -> None:
        self.policy = LossScalePolicy.of(locals())  # validates every argument
        super().__init__(initial_scale, verbose)
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.hysteresis = int(hysteresis)
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    @classmethod
    def from_policy(cls, policy: LossScalePolicy, verbose: bool = False) -> DynamicGradScaler:
        """The scaler following ``policy``.

        Example:
            >>> DynamicGradScaler.from_policy(LossScalePolicy(initial_scale=8)).scale
            8.0
        """
        return cls(**policy.as_kwargs(), verbose=verbose)

    @property
    def growth_tracker(self) -> int:
        """Consecutive good steps since the last overflow or growth."""
        return self._growth_tracker

    @property
    def hysteresis_tracker(self) -> int:
        """Overflows still tolerated before backoff starts (0: every overflow backs off)."""
        return self._hysteresis_tracker

    def update(self, found_inf: bool) -> ScaleEvent:
        if bool(found_inf):
            self._growth_tracker = 0
            self._hysteresis_tracker = max(self._hysteresis_tracker - 1, 0)
            if self._hysteresis_tracker > 0:
                return ScaleEvent.TOLERATE
            self._set_scale(max(self._scale * self.backoff_factor, self.min_scale), "overflow")
            return ScaleEvent.BACKOFF
        self._growth_tracker += 1
        if self._growth_tracker < self.growth_interval:
            return ScaleEvent.GOOD
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis
        self._set_scale(min(self._scale * self.growth_factor, self.max_scale), "growth")
        return ScaleEvent.GROW

    def _set_scale(self, new_scale: float, reason: str) -> None:
        if self.verbose and new_scale != self._scale:
            _logger.info("loss scale %g -> %g (%s)", self._scale, new_scale, reason)
        self._scale = new_scale

    def state_dict(self) -> dict[str, Any]:
        """The scale, both trackers, and (for inspection) the hyper-parameters.

        Example:
            >>> DynamicGradScaler(initial_scale=4).state_dict()["scale"]
            4.0
        """
        state = {"scale": self._scale, "growth_tracker": self._growth_tracker}
        state["hysteresis_tracker"] = self._hysteresis_tracker
        return state | {name: getattr(self, name) for name in _HYPER_PARAMETERS.split()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the scale and the trackers.

        The hyper-parameters stored in ``state_dict`` are not loaded: the ones this scaler was
        built with win, so a run may resume with another policy. A scale outside
        ``[min_scale, max_scale]`` is clamped into it (with a warning); missing trackers (e.g. a
        dict holding only ``'scale'``) start afresh.

        Raises:
            KeyError: ``state_dict`` has no ``'scale'``.
            ValueError: the stored scale is not a finite number > 0.
        """
        scale = self._load_scale(state_dict)
        clamped = min(max(scale, self.min_scale), self.max_scale)
        if clamped != scale:
            bounds = f"[min_scale={self.min_scale:g}, max_scale={self.max_scale:g}]"
            _logger.warning(
                "loaded loss scale %g lies outside %s; using %g", scale, bounds, clamped
            )
        self._scale = clamped
        growth = int(state_dict.get("growth_tracker", 0))
        self._growth_tracker = min(max(growth, 0), self.growth_interval - 1)
        budget = int(state_dict.get("hysteresis_tracker", self.hysteresis))
        self._hysteresis_tracker = min(max(budget, 0), self.hysteresis)
