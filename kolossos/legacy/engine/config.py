"""``EngineConfig``: the feature keys of the launch config that ``initialize`` reads, checked
before anything is built or communicated."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kolossos.booster.mixed_precision import MixedPrecision
from kolossos.ddp import TorchDDPConfig
from kolossos.legacy.amp.amp_type import AMP_TYPE, parse_amp_mode
from kolossos.legacy.amp.convert import build_amp_recipe
from kolossos.legacy.context.reserved_keys import check_reserved_keys
from kolossos.legacy.engine.errors import EngineConfigError
from kolossos.legacy.engine.gradient_handler import BaseGradientHandler
from kolossos.legacy.engine.zero import ZeroSettings
from kolossos.legacy.registry import GRADIENT_HANDLER

__all__ = ["EngineConfig", "EngineConfigError"]


def _amp(config: Mapping[str, Any]) -> tuple[AMP_TYPE | None, MixedPrecision | None]:
    fp16 = config.get("fp16")
    if fp16 is None:
        return None, None
    if "mode" not in fp16:
        raise EngineConfigError(
            f"config key fp16={dict(fp16)!r} has no mode; write fp16=dict(mode=AMP_TYPE.TORCH) "
            "(or NAIVE, APEX), or leave fp16 out for fp32 training."
        )
    if fp16["mode"] is None:
        return None, None
    mode = parse_amp_mode(fp16["mode"])
    return mode, build_amp_recipe(mode, fp16)


def _handlers(config: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    if config.get("gradient_handler") is not None and config.get("gradient_handlers") is not None:
        raise EngineConfigError(
            "the config sets both gradient_handler and gradient_handlers (two spellings of one "
            "key); keep one."
        )
    entries = config.get("gradient_handler", config.get("gradient_handlers"))
    if entries is None:
        return None
    if not isinstance(entries, Sequence) or isinstance(entries, str):
        raise EngineConfigError(
            f"gradient_handler={entries!r} must be a list: [dict(type='HandlerName', **kwargs)]."
        )
    out = []
    for entry in entries:
        if not isinstance(entry, Mapping) or not isinstance(entry.get("type"), str):
            raise EngineConfigError(
                f"gradient_handler entry {entry!r} must be a dict with a 'type' naming a "
                "registered handler, e.g. dict(type='DataParallelGradientHandler')."
            )
        if not GRADIENT_HANDLER.has(entry["type"]):
            raise EngineConfigError(
                f"gradient_handler type {entry['type']!r} is not registered; register the class "
                "with @GRADIENT_HANDLER.register_module (from kolossos.registry import "
                "GRADIENT_HANDLER) before initialize, or use 'DataParallelGradientHandler'."
            )
        cls = GRADIENT_HANDLER.get_module(entry["type"])
        if not (isinstance(cls, type) and issubclass(cls, BaseGradientHandler)):
            raise EngineConfigError(
                f"gradient_handler type {entry['type']!r} is {cls!r}, not a subclass of "
                "kolossos.engine.BaseGradientHandler."
            )
        out.append(dict(entry))
    return out


def _torch_ddp(config: Mapping[str, Any]) -> TorchDDPConfig:
    options = dict(config.get("torch_ddp") or {})
    try:
        return TorchDDPConfig(**options)
    except TypeError as err:
        raise EngineConfigError(
            f"config key torch_ddp={options!r}: {err}; it takes DistributedDataParallel's "
            "keyword arguments (bucket_cap_mb, find_unused_parameters, ...)."
        ) from err


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """What ``initialize`` injects, read from ``gpc.config`` by :meth:`from_config`."""

    amp_mode: AMP_TYPE | None = None
    """The ``fp16`` key's mode (``None``: fp32)."""
    amp: MixedPrecision | None = field(default=None, compare=False)
    """The validated mixed-precision recipe of ``fp16``'s other keys."""
    gradient_accumulation: int | None = None
    """Iterations per optimizer step (``None``: no accumulation)."""
    clip_grad_norm: float = 0.0
    """Global gradient-norm limit applied by ``engine.step()`` (0: off)."""
    gradient_handlers: list[dict[str, Any]] | None = None
    """The ``gradient_handler`` entries (``None``: torch DDP when data-parallel)."""
    torch_ddp: TorchDDPConfig = field(default_factory=TorchDDPConfig)
    """DDP's options (the ``torch_ddp`` key)."""
    cudnn_benchmark: bool = False
    """``torch.backends.cudnn.benchmark``."""
    cudnn_deterministic: bool = False
    """``torch.backends.cudnn.deterministic``."""
    zero: ZeroSettings | None = None
    """The ``zero`` key: the ZeRO engine and its options (``None``: no ZeRO)."""

    def __post_init__(self) -> None:
        if self.gradient_accumulation is not None and self.gradient_accumulation < 1:
            raise EngineConfigError(
                f"gradient_accumulation={self.gradient_accumulation} must be >= 1."
            )
        if self.clip_grad_norm < 0:
            raise EngineConfigError(
                f"clip_grad_norm={self.clip_grad_norm} must be >= 0 (0 switches it off)."
            )

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> EngineConfig:
        """Check and read the feature keys (no process group is touched).

        Raises:
            EngineConfigError: a bad value (unknown handler type, fp16 without a mode, both
                ``fp16`` and ``zero``...).
            ValueError, TypeError: a bad ``fp16`` mode or argument.
            ZeroConfigError: a bad ``zero`` key.
            NotImplementedError: the older ``amp`` key.
        """
        check_reserved_keys(config)  # types first: a mapping that did not come through launch
        zero, fp16 = config.get("zero"), config.get("fp16")
        if zero is not None and fp16 is not None and fp16.get("mode") is not None:
            raise EngineConfigError(
                "the config sets both fp16 and zero, which cannot be combined (ZeRO keeps its own "
                "fp16 master weights); remove fp16, or remove zero."
            )
        if config.get("amp") is not None:
            raise NotImplementedError(
                "config key amp is not read by initialize; write the AMP settings as "
                "fp16=dict(mode=AMP_TYPE.TORCH, ...)."
            )
        mode, recipe = _amp(config)
        return cls(
            amp_mode=mode,
            amp=recipe,
            gradient_accumulation=config.get("gradient_accumulation"),
            clip_grad_norm=float(config.get("clip_grad_norm") or 0.0),
            gradient_handlers=_handlers(config),
            torch_ddp=_torch_ddp(config),
            cudnn_benchmark=bool(config.get("cudnn_benchmark", False)),
            cudnn_deterministic=bool(config.get("cudnn_deterministic", False)),
            zero=None if zero is None else ZeroSettings.from_config(zero),
        )
