"""``GeminiConfig``: the arguments of ``GeminiPlugin`` and ``zero_model_wrapper(zero_stage=3)``,
validated before anything is built or communicated.

One frozen object carries every Gemini option; :meth:`GeminiConfig.ddp_kwargs` and
:meth:`GeminiConfig.optimizer_kwargs` split it into the keyword arguments of
:class:`~kolossos.zero.gemini.GeminiDDP` and :class:`~kolossos.zero.gemini.GeminiOptimizer`.
Options that only one placement policy reads are refused under the others instead of being
ignored, so a configuration always means what it says.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from kolossos.amp import LossScalePolicy
from kolossos.utils.checks import check_flags
from kolossos.zero.gemini.placement.budget import check_fraction
from kolossos.zero.gemini.placement.config import POLICY_ALIASES, POLICY_NAMES, PlacementConfig
from kolossos.zero.low_level.options import check_norm_type

__all__ = ["GEMINI_PRECISIONS", "PLACEMENT_POLICIES", "GeminiConfig"]

#: precision name -> working dtype of the parameters during forward and backward
GEMINI_PRECISIONS = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}

#: accepted ``placement_policy`` names: the two policies and the documents' older aliases
PLACEMENT_POLICIES = (*POLICY_NAMES, *POLICY_ALIASES)

_SEARCH = {"search_range_m": 32, "hidden_dim": None, "min_chunk_size_m": 32}
_MB_ALIASES = (("search_range_mb", "search_range_m"), ("min_chunk_size_mb", "min_chunk_size_m"))
_OPTIMIZER_FIELDS = ("gpu_margin_mem_ratio", "loss_scale", "max_norm", "norm_type")


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise TypeError(f"{name}={value!r} must be a number.")
    return float(value)


def _device(name: str, value: object) -> torch.device | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int, torch.device)):
        raise TypeError(f"{name}={value!r} must be None, a torch.device, a str or an int.")
    if isinstance(value, int):  # the documents pass torch.cuda.current_device(), an index
        if value < 0:
            raise ValueError(f"{name}={value!r} must be a device index >= 0 (or None).")
        return torch.device("cuda", value)
    try:
        return torch.device(value)
    except RuntimeError as exc:
        raise ValueError(f"{name}={value!r} is not a device name ({exc}).") from None


@dataclass(frozen=True, kw_only=True)
class GeminiConfig:
    """Every Gemini option (Colossal-AI's names and defaults), validated in ``__post_init__``.

    Example:
        >>> GeminiConfig(placement_policy="static", offload_optim_frac=0.5).ddp_kwargs()[
        ...     "offload_optim_frac"]
        0.5
    """

    chunk_config_dict: dict[Any, Any] | None = None
    """A ready chunk configuration ``{"chunk_size": elements}`` (e.g. the entry ``config[N]`` of
    what ``search_chunk_configuration`` returns); replaces the search, so ``search_range_m``,
    ``hidden_dim`` and ``min_chunk_size_m`` must stay default."""
    chunk_init_device: torch.device | None = None
    """Where chunks are first allocated (default: where the placement policy puts them)."""
    placement_policy: str = "static"
    """``'static'`` (fixed fractions below), ``'auto'`` (moves chunks by measured memory), or
    the documents' aliases ``'cuda'`` (all on the device), ``'cpu'`` (chunks and optimizer
    states on the host) and ``'const'``."""
    shard_param_frac: float = 1.0
    """static: fraction of the parameter chunks sharded over the ranks (the rest replicated)."""
    offload_optim_frac: float = 0.0
    """static: fraction of the optimizer states (and fp32 masters) kept on the host."""
    offload_param_frac: float = 0.0
    """static: fraction of the parameter chunks kept on the host between uses; needs
    ``shard_param_frac=1.0``."""
    warmup_non_model_data_ratio: float = 0.8
    """auto: share of device memory assumed free for model data during the warm-up iteration."""
    steady_cuda_cap_ratio: float = 0.9
    """auto: share of device memory model data may use once statistics exist."""
    precision: str = "fp16"
    """Working dtype of the parameters: ``'fp16'`` (dynamic loss scale), ``'bf16'``, or
    ``'fp32'`` (a kolossos extension, exact on CPU); the optimizer steps fp32 masters."""
    pin_memory: bool = False
    """Pin host copies of chunks (faster transfers; ignored by the CPU backend's pinning)."""
    force_outputs_fp32: bool = False
    """Cast floating outputs of the model to fp32."""
    strict_ddp_mode: bool = False
    """Every parameter is data-parallel (replicated before sharding), as in plain DDP."""
    search_range_m: float = 32
    """Width of the chunk-size search, in millions (2**20) of elements."""
    hidden_dim: int | None = None
    """Search step (the model's hidden size); ``None``: 1024."""
    min_chunk_size_m: float = 32
    """Smallest chunk, in millions of elements: smaller models go into one chunk."""
    memstats: Any = None
    """auto: memory statistics collected beforehand (skips the warm-up measurement)."""
    gpu_margin_mem_ratio: float = 0.0
    """auto/const: share of the spare device memory (measured in warm-up) that optimizer states
    of host-resident chunks may move into, so those chunks step on the device."""
    loss_scale: LossScalePolicy = field(default_factory=LossScalePolicy)
    """The fp16 loss-scale policy (Colossal-AI's seven keywords, ``initial_scale=2**16`` ...)."""
    max_norm: float = 0.0
    """Clip gradients to this global norm at every step (0: no clipping)."""
    norm_type: float = 2.0
    """Norm used for ``max_norm`` (``float('inf')``: max norm)."""
    verbose: bool = False
    """Log the chunk search and placement decisions on rank 0."""
    device: torch.device | None = None
    """Colossal-AI 0.3.1's ``device``: must be this process's accelerator device (the only one
    Gemini computes on); ``None``: that device."""
    device_memory_budget: int | None = None
    """kolossos extension: bytes of device memory Gemini may fill with chunks (default: the
    accelerator's total). Lets CPU runs exercise eviction with a small budget."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "device", _device("device", self.device))
        object.__setattr__(
            self, "chunk_init_device", _device("chunk_init_device", self.chunk_init_device)
        )
        self._check_placement()
        self._check_chunks()
        if not isinstance(self.precision, str) or self.precision not in GEMINI_PRECISIONS:
            raise ValueError(
                f"precision={self.precision!r} must be one of {sorted(GEMINI_PRECISIONS)}; "
                "GeminiPlugin controls precision, so do not pass Booster(mixed_precision=)."
            )
        check_flags(self, ("pin_memory", "force_outputs_fp32", "strict_ddp_mode", "verbose"))
        if not isinstance(self.loss_scale, LossScalePolicy):
            raise TypeError(f"loss_scale={self.loss_scale!r} must be a LossScalePolicy.")
        clip = _number("max_norm", self.max_norm)
        if not 0 <= clip < math.inf:
            raise ValueError(f"max_norm={clip!r} must be a finite number >= 0 (0: no clipping).")
        check_norm_type(self.norm_type)

    def _check_placement(self) -> None:
        """The placement options, checked by the placement layer's own rules (aliases resolved,
        options of the other policy refused), plus the optimizer's auto-only options."""
        placement = PlacementConfig.from_user(
            self.placement_policy,
            shard_param_frac=self.shard_param_frac,
            offload_optim_frac=self.offload_optim_frac,
            offload_param_frac=self.offload_param_frac,
            warmup_non_model_data_ratio=self.warmup_non_model_data_ratio,
            steady_cuda_cap_ratio=self.steady_cuda_cap_ratio,
            device_memory_budget=self.device_memory_budget,
        )
        check_fraction("gpu_margin_mem_ratio", self.gpu_margin_mem_ratio)
        measured = placement.policy == "auto" and placement.use_mem_stats
        if self.gpu_margin_mem_ratio != 0.0 and placement.policy != "auto":
            raise ValueError(
                f"gpu_margin_mem_ratio={self.gpu_margin_mem_ratio} needs placement_policy='auto' "
                f"(or 'const'), got {self.placement_policy!r}: the static policy places "
                "optimizer states by offload_optim_frac. Set it to 0.0."
            )
        if self.memstats is not None and not measured:
            raise ValueError(
                "memstats is read by placement_policy='auto' only (got "
                f"{self.placement_policy!r}); drop it or use placement_policy='auto'."
            )

    def _check_chunks(self) -> None:
        if self.chunk_config_dict is not None:
            if not isinstance(self.chunk_config_dict, dict):
                raise TypeError(
                    f"chunk_config_dict must be a dict (from search_chunk_configuration), got "
                    f"{type(self.chunk_config_dict).__name__}."
                )
            size = self.chunk_config_dict.get("chunk_size")
            extra = set(self.chunk_config_dict) - {"chunk_size", "keep_gathered"}
            if isinstance(size, bool) or not isinstance(size, int) or size <= 0 or extra:
                raise ValueError(
                    f"chunk_config_dict={self.chunk_config_dict!r}: expected {{'chunk_size': "
                    "elements (a positive int), 'keep_gathered': False}: one entry config[N] "
                    "of what search_chunk_configuration returns (keyed by the group size N)."
                )
            if self.chunk_config_dict.get("keep_gathered"):
                raise NotImplementedError(
                    "chunk_config_dict keep_gathered=True: keep parameters gathered with "
                    "shard_param_frac=0.0 instead."
                )
            changed = [n for n, d in _SEARCH.items() if getattr(self, n) != d]
            if changed:
                raise ValueError(
                    f"chunk_config_dict replaces the chunk search, so {', '.join(changed)} would "
                    "be ignored; pass either chunk_config_dict or the search arguments."
                )
        search = _number("search_range_m", self.search_range_m)
        if not 0 < search < math.inf:
            raise ValueError(
                f"search_range_m={self.search_range_m!r} must be a positive number of millions "
                "of elements, e.g. 32."
            )
        smallest = _number("min_chunk_size_m", self.min_chunk_size_m)
        if not 0 <= smallest < math.inf:
            raise ValueError(
                f"min_chunk_size_m={self.min_chunk_size_m!r} must be a number >= 0 of millions "
                "of elements, e.g. 32."
            )
        dim = self.hidden_dim
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int) or dim < 1):
            raise ValueError(f"hidden_dim={dim!r} must be None or a positive int (the model's).")

    # ------------------------------------------------------------------ derived
    @property
    def dtype(self) -> torch.dtype:
        """The working dtype of ``precision``."""
        return GEMINI_PRECISIONS[self.precision]

    def check_device(self, current: torch.device) -> None:
        """Raise unless ``device`` (if given) is ``current``, the device Gemini computes on."""
        device = self.device
        if device is None:
            return
        same_index = device.index is None or device.index == (current.index or 0)
        if device.type != current.type or not same_index:
            raise ValueError(
                f"device={device} but this process computes on {current}: Gemini places chunks "
                "on the accelerator's current device; pass device=None (or that device)."
            )

    def ddp_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``GeminiDDP`` (all but the module and process group)."""
        skip = {*_OPTIMIZER_FIELDS, "precision", "device"}
        kwargs = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        kwargs["mixed_precision"] = self.dtype
        return kwargs

    def optimizer_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``GeminiOptimizer`` (all but the optimizer and module)."""
        kwargs: dict[str, Any] = {
            "gpu_margin_mem_ratio": self.gpu_margin_mem_ratio,
            **self.loss_scale.as_kwargs(),
        }
        kwargs["max_norm"] = float(self.max_norm)
        kwargs["norm_type"] = float(self.norm_type)
        kwargs["verbose"] = self.verbose
        return kwargs

    @classmethod
    def from_ddp_kwargs(cls, kwargs: dict[str, Any]) -> GeminiConfig:
        """The configuration of a ``GeminiDDP``-style keyword dict (``zero_model_wrapper``'s
        ``gemini_config``): ``mixed_precision`` (a dtype) becomes ``precision``, and the
        documents' ``search_range_mb`` / ``min_chunk_size_mb`` spellings are accepted.

        Raises:
            TypeError: an unknown key (the message lists the accepted ones).
        """
        given = dict(kwargs)
        for old, new in _MB_ALIASES:
            if old in given:
                if new in given:
                    raise TypeError(f"gemini_config has both {old!r} and {new!r}; keep one.")
                given[new] = given.pop(old)
        if "mixed_precision" in given:
            dtype = given.pop("mixed_precision")
            names = {v: k for k, v in GEMINI_PRECISIONS.items()}
            if dtype not in names:
                raise ValueError(
                    f"mixed_precision={dtype!r} must be torch.float16, torch.bfloat16 or "
                    "torch.float32."
                )
            given["precision"] = names[dtype]
        allowed = {f.name for f in fields(cls)} - set(_OPTIMIZER_FIELDS)
        unknown = sorted(set(given) - allowed)
        if unknown:
            raise TypeError(
                f"unknown Gemini model option(s) {', '.join(unknown)}; accepted: "
                f"{', '.join(sorted(allowed | {'mixed_precision'}))} (optimizer options such as "
                "initial_scale go to zero_optim_wrapper)."
            )
        return cls(**given)
