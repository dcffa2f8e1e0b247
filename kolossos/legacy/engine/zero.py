"""The ``zero`` key of the launch config: ZeRO through ``initialize``, on the Booster's ZeRO
engines.

Colossal-AI's legacy ``zero=dict(model_config=dict(...), optimizer_config=dict(...))`` built its
sharded (ZeRO-3) model and optimizer. kolossos maps it onto :class:`GeminiPlugin` (ZeRO-3 over
chunks), and, with ``stage=1`` or ``2`` (``level`` is accepted as Colossal-AI 0.1 spelled it),
onto :class:`LowLevelZeroPlugin`::

    zero = dict(
        stage=3,                                   # 1, 2 (LowLevelZero) or 3 (Gemini, default)
        precision="fp16",                          # or "bf16", "fp32" (kolossos; default fp16)
        model_config=dict(tensor_placement_policy="cpu"),   # Gemini options
        optimizer_config=dict(initial_scale=2**5),          # loss scale, cpu_offload, ...
    )

Options the chunked engines decide themselves (``shard_strategy``, ``reuse_fp16_shard``,
``fp32_reduce_scatter``, ``reduce_scatter_bucket_size_mb``, ``gradient_predivide_factor`` and
the process-group keys) are accepted and ignored with one warning naming them.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kolossos.booster.plugin import GeminiPlugin, LowLevelZeroPlugin
from kolossos.booster.plugin.plugin_base import config_from_arguments
from kolossos.legacy.engine.errors import EngineConfigError
from kolossos.zero.gemini.gemini_config import GeminiConfig
from kolossos.zero.low_level.config import LowLevelZeroConfig

__all__ = ["ZeroSettings"]

_TOP_KEYS = {"stage", "level", "precision", "model_config", "optimizer_config"}
#: Colossal-AI's ShardedModelV2 / ShardedOptimizerV2 options that the chunked engines decide
#: themselves (they shard every chunk over the data-parallel group of the launch)
_DECIDED_BY_ENGINE = {
    "shard_strategy",
    "reuse_fp16_shard",
    "fp32_reduce_scatter",
    "reduce_scatter_bucket_size_mb",
    "gradient_predivide_factor",
    "process_group",
    "reduce_scatter_process_group",
    "dp_process_group",
    "mp_process_group",
}
_SCALE_KEYS = (
    "initial_scale",
    "min_scale",
    "max_scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "hysteresis",
)


_OTHER_OPTIM_KEYS = ("cpu_offload", "verbose", "gpu_margin_mem_ratio")


def _section(zero: Mapping[str, Any], name: str) -> dict[str, Any]:
    value = zero.get(name) or {}
    if not isinstance(value, Mapping):
        raise EngineConfigError(f"zero.{name}={value!r} must be a dict of options (or left out).")
    return dict(value)


def _stage(zero: Mapping[str, Any]) -> int:
    if "stage" in zero and "level" in zero:
        raise EngineConfigError("zero sets both stage and level (two spellings); keep one.")
    stage = zero.get("stage", zero.get("level", 3))
    if isinstance(stage, bool) or stage not in (1, 2, 3):
        raise EngineConfigError(
            f"zero stage={stage!r} must be 1 or 2 (ZeRO-1/2: LowLevelZero) or 3 (Gemini)."
        )
    return int(stage)


def _plugin_kwargs(
    stage: int, precision: str, model: dict[str, Any], optim: dict[str, Any]
) -> dict[str, Any]:
    """The plugin's keyword arguments from the two option dicts."""
    kwargs: dict[str, Any] = {"precision": precision}
    if "tensor_placement_policy" in model:
        model["placement_policy"] = model.pop("tensor_placement_policy")
    cpu_offload = bool(optim.pop("cpu_offload", False))
    kwargs.update({k: optim.pop(k) for k in _SCALE_KEYS if k in optim})
    if "verbose" in optim:
        kwargs["verbose"] = optim.pop("verbose")
    if stage == 3:
        if "gpu_margin_mem_ratio" in optim:
            kwargs["gpu_margin_mem_ratio"] = optim.pop("gpu_margin_mem_ratio")
        if cpu_offload:
            kwargs["offload_optim_frac"] = 1.0
    elif cpu_offload:
        kwargs["cpu_offload"] = True
    if optim:
        raise EngineConfigError(
            f"unknown zero.optimizer_config option(s) {', '.join(sorted(optim))}; accepted: "
            f"{', '.join(sorted({*_SCALE_KEYS, *_OTHER_OPTIM_KEYS}))}."
        )
    clash = sorted(set(model) & set(kwargs))
    if clash:
        raise EngineConfigError(
            f"zero.model_config repeats {', '.join(clash)}; give each option once."
        )
    kwargs.update(model)
    return {"stage": stage, **kwargs} if stage < 3 else kwargs


@dataclass(frozen=True)
class ZeroSettings:
    """The checked ``zero`` key: which engine, and its options."""

    stage: int
    """1 or 2: :class:`LowLevelZeroPlugin`; 3: :class:`GeminiPlugin`."""
    plugin_kwargs: dict[str, Any] = field(default_factory=dict)
    """The plugin's keyword arguments."""
    ignored: tuple[str, ...] = ()
    """Colossal-AI options the engines decide themselves (warned about once)."""

    @classmethod
    def from_config(cls, zero: Any) -> ZeroSettings:
        """Check ``zero`` and map it onto a plugin's arguments (no process group is touched).

        Raises:
            EngineConfigError: an unknown key or option, a bad stage or precision, a bad option
                value (the engine config's own message).
        """
        if not isinstance(zero, Mapping):
            raise EngineConfigError(
                f"zero={zero!r} must be a dict, e.g. zero=dict(stage=2) or "
                "zero=dict(model_config=dict(...), optimizer_config=dict(...))."
            )
        unknown = sorted(set(zero) - _TOP_KEYS)
        if unknown:
            raise EngineConfigError(
                f"unknown zero key(s) {', '.join(unknown)}; accepted: "
                f"{', '.join(sorted(_TOP_KEYS))}."
            )
        stage = _stage(zero)
        precision = zero.get("precision", "fp16")
        if precision not in ("fp16", "bf16", "fp32"):
            raise EngineConfigError(
                f"zero precision={precision!r} must be 'fp16', 'bf16' or 'fp32'."
            )
        model, optim = _section(zero, "model_config"), _section(zero, "optimizer_config")
        ignored = tuple(sorted((set(model) | set(optim)) & _DECIDED_BY_ENGINE))
        for name in ignored:
            model.pop(name, None)
            optim.pop(name, None)
        if stage < 3 and model:
            raise EngineConfigError(
                f"zero.model_config options {', '.join(sorted(model))} configure the ZeRO-3 "
                f"model (Gemini); with stage={stage} leave model_config out or use stage=3."
            )
        kwargs = _plugin_kwargs(stage, precision, model, optim)
        try:  # the engine config checks every value before any collective
            config_from_arguments(LowLevelZeroConfig if stage < 3 else GeminiConfig, kwargs)
        except (TypeError, ValueError) as err:
            raise EngineConfigError(f"config key zero: {err}") from err
        return cls(stage=stage, plugin_kwargs=kwargs, ignored=ignored)

    def build_plugin(self) -> LowLevelZeroPlugin | GeminiPlugin:
        """The Booster plugin (needs the process group of the launch)."""
        if self.ignored:
            warnings.warn(
                f"zero options {', '.join(self.ignored)} are decided by kolossos' ZeRO engines "
                "(every chunk is sharded over the data-parallel group) and are ignored.",
                stacklevel=3,
            )
        if self.stage < 3:
            return LowLevelZeroPlugin(**self.plugin_kwargs)
        return GeminiPlugin(**self.plugin_kwargs)
