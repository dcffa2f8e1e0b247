"""Validated options of Gemini's placement policies, and the policy names the docs use.

Two policies exist: ``static`` (fixed fractions of the chunks sharded / offloaded) and ``auto``
(the memory manager: statistics from a warm-up iteration, then chunks moved between device and host
ahead of need). Older documentation names map onto them:

=========  ===========================================================================
``cuda``   ``static``, everything on the device (no offloading)
``cpu``    ``static`` with ``offload_optim_frac=1.0`` and ``offload_param_frac=1.0``
``const``  ``auto`` without statistics: model data capped at a constant share of the
           device budget, ``1 - warmup_non_model_data_ratio``, for the whole run
=========  ===========================================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kolossos.zero.gemini.placement.budget import check_fraction

__all__ = ["POLICY_ALIASES", "POLICY_NAMES", "PlacementConfig"]

#: canonical policy names
POLICY_NAMES = ("static", "auto")
#: older names -> (canonical name, the fraction settings the alias stands for)
POLICY_ALIASES: dict[str, tuple[str, dict[str, float]]] = {
    "cuda": ("static", {"offload_optim_frac": 0.0, "offload_param_frac": 0.0}),
    "cpu": ("static", {"offload_optim_frac": 1.0, "offload_param_frac": 1.0}),
    "const": ("auto", {}),
}
_STATIC_DEFAULTS = {"shard_param_frac": 1.0, "offload_optim_frac": 0.0, "offload_param_frac": 0.0}
_AUTO_DEFAULTS = {"warmup_non_model_data_ratio": 0.8, "steady_cuda_cap_ratio": 0.9}


@dataclass(frozen=True, kw_only=True)
class PlacementConfig:
    """Where Gemini keeps chunks, after alias resolution.

    Build it with :meth:`from_user` to accept the documented names and aliases.
    """

    policy: str = "static"
    """``"static"`` or ``"auto"`` (aliases already resolved)."""
    alias: str | None = None
    """The older name the user wrote (``"cuda"``, ``"cpu"``, ``"const"``), if any."""
    shard_param_frac: float = 1.0
    """static: share of chunk bytes whose parameters are sharded; the rest stay gathered on the
    device on every rank (more memory, less communication)."""
    offload_optim_frac: float = 0.0
    """static: share of chunk bytes whose fp32 masters and optimizer states live on the host."""
    offload_param_frac: float = 0.0
    """static: share of chunk bytes whose parameter shards live on the host between uses."""
    warmup_non_model_data_ratio: float = 0.8
    """auto: share of the device budget reserved for non-model data while warming up (and, for
    ``const``, always); model data gets the rest."""
    steady_cuda_cap_ratio: float = 0.9
    """auto: share of the device budget usable after warm-up (measured non-model peak included)."""
    device_memory_budget: int | None = None
    """auto: bytes of device memory to plan with; ``None``: the accelerator's total memory."""
    use_mem_stats: bool = True
    """auto: collect memory statistics during warm-up (False for the ``const`` alias)."""

    def __post_init__(self) -> None:
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"policy={self.policy!r} must be one of {POLICY_NAMES}.")
        for name in (*_STATIC_DEFAULTS, *_AUTO_DEFAULTS):
            check_fraction(name, getattr(self, name))
        if self.steady_cuda_cap_ratio == 0.0:
            raise ValueError("steady_cuda_cap_ratio=0.0 leaves no device memory; pass e.g. 0.9.")
        if self.warmup_non_model_data_ratio == 1.0:
            raise ValueError(
                "warmup_non_model_data_ratio=1.0 leaves no device memory for model data while "
                "warming up; pass e.g. 0.8."
            )
        budget = self.device_memory_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)):
            raise TypeError(f"device_memory_budget={budget!r} must be an int (bytes) or None.")
        if budget is not None and budget <= 0:
            raise ValueError(f"device_memory_budget={budget!r} must be a positive byte count.")
        if self.offload_param_frac > 0.0:
            self._check_param_offload()

    def _check_param_offload(self) -> None:
        """Offloaded parameter shards must be sharded and have their optimizer on the host."""
        if self.shard_param_frac != 1.0:
            raise ValueError(
                f"offload_param_frac={self.offload_param_frac} needs shard_param_frac=1.0 (got "
                f"{self.shard_param_frac}): only sharded parameters can live on the host."
            )
        if self.offload_param_frac > self.offload_optim_frac:
            raise ValueError(
                f"offload_param_frac={self.offload_param_frac} must not exceed "
                f"offload_optim_frac={self.offload_optim_frac}: a parameter shard on the host "
                "is updated there, so its optimizer states must live there too. Raise "
                "offload_optim_frac (e.g. to 1.0)."
            )

    @classmethod
    def from_user(cls, placement_policy: str = "static", **kwargs: Any) -> PlacementConfig:
        """Resolve a documented policy name (or alias) and its keyword arguments.

        Options of the other policy must keep their defaults: they would otherwise be ignored.

        Raises:
            ValueError: an unknown name, a value out of range, an option that the chosen policy
                does not use, or a fraction that contradicts the alias.
            TypeError: an unknown keyword, or a name that is not a string.
        """
        unknown = set(kwargs) - set(_STATIC_DEFAULTS) - set(_AUTO_DEFAULTS)
        unknown -= {"device_memory_budget"}
        if unknown:
            raise TypeError(
                f"unknown placement options {sorted(unknown)}; known: "
                f"{sorted([*_STATIC_DEFAULTS, *_AUTO_DEFAULTS, 'device_memory_budget'])}."
            )
        if not isinstance(placement_policy, str):
            raise TypeError(f"placement_policy={placement_policy!r} must be a str, e.g. 'auto'.")
        name = placement_policy.lower()
        alias: str | None = None
        forced: dict[str, float] = {}
        if name in POLICY_ALIASES:
            alias, (name, forced) = name, POLICY_ALIASES[name]
        if name not in POLICY_NAMES:
            raise ValueError(
                f"placement_policy={placement_policy!r} is unknown; use 'static' or 'auto' (or "
                f"the older names {sorted(POLICY_ALIASES)})."
            )
        unused = _STATIC_DEFAULTS if name == "auto" else _AUTO_DEFAULTS
        for key, default in unused.items():
            if key in kwargs and kwargs[key] != default:
                raise ValueError(
                    f"{key}={kwargs[key]!r} has no effect with placement_policy="
                    f"{placement_policy!r}; leave it at {default} or choose the "
                    f"{'static' if name == 'auto' else 'auto'} policy."
                )
        if name == "static" and kwargs.get("device_memory_budget") is not None:
            raise ValueError(
                f"device_memory_budget={kwargs['device_memory_budget']!r} is only honoured by "
                "placement_policy='auto' (or 'const'); the static policy does not move chunks "
                "by memory pressure. Drop it or use placement_policy='auto'."
            )
        for key, value in forced.items():
            if key in kwargs and kwargs[key] not in (value, _STATIC_DEFAULTS[key]):
                raise ValueError(
                    f"{key}={kwargs[key]!r} contradicts placement_policy={placement_policy!r}, "
                    f"which means {key}={value}; use placement_policy='static' to choose it."
                )
        options = {k: v for k, v in kwargs.items() if k not in unused}
        options.update(forced)
        return cls(policy=name, alias=alias, use_mem_stats=alias != "const", **options)
