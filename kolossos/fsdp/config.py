"""``TorchFSDPConfig``: what the FSDP recipe does, in FSDP2 terms, after argument mapping.

:mod:`kolossos.fsdp.config_mapping` turns Colossal-AI's (FSDP1-style) keyword arguments into this
object; everything downstream (mesh, wrapping, sharding, optimizer, checkpoints) reads only it.
The config holds no process groups it created itself: building the mesh is a collective and
happens later, in :func:`kolossos.fsdp.mesh.build_mesh`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from kolossos.amp import LossScalePolicy
from kolossos.utils.checks import check_flags

__all__ = ["CHECKPOINT_FORMATS", "PRECISIONS", "SHARDING_MODES", "TorchFSDPConfig"]

#: sharding strategies (FSDP1 ``ShardingStrategy`` member names) that have an FSDP2 equivalent
SHARDING_MODES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
#: compute precisions of the plugin's ``precision=`` argument
PRECISIONS = ("fp32", "bf16", "fp16")
#: what ``save_model(..., shard=True)`` / ``save_optimizer(..., shard=True)`` write
CHECKPOINT_FORMATS = ("hf", "dcp")

_LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class TorchFSDPConfig:
    """The FSDP2 recipe of :class:`~kolossos.booster.plugin.TorchFSDPPlugin`.

    Example:
        >>> cfg = TorchFSDPConfig(
        ...     sharding="SHARD_GRAD_OP", precision="bf16", param_dtype=torch.bfloat16
        ... )
        >>> cfg.reshard_after_forward, cfg.hybrid, cfg.loss_scaled
        (False, False, False)
    """

    sharding: str = "FULL_SHARD"
    """FSDP1 strategy name: ``FULL_SHARD`` and ``HYBRID_SHARD`` reshard parameters after forward
    (ZeRO-3), ``SHARD_GRAD_OP`` and ``_HYBRID_SHARD_ZERO2`` keep them until backward (ZeRO-2),
    ``NO_SHARD`` replicates them (DDP-like); the ``HYBRID`` ones shard within a group and
    replicate across groups (HSDP, a 2-D mesh)."""
    process_group: Any = None
    """The data-parallel ``ProcessGroup`` (default: every process), or for the hybrid
    strategies a ``(shard_group, replicate_group)`` pair as FSDP1 accepts."""
    device_mesh: Any = None
    """A ready ``DeviceMesh`` (1-D for the plain strategies, 2-D ``(replicate, shard)`` for the
    hybrid ones); overrides ``process_group``."""
    offload_params: bool = False
    """Keep sharded parameters, gradients and optimizer states in CPU memory (FSDP2's
    ``CPUOffloadPolicy``); a no-op without an accelerator, where they are there already."""
    auto_wrap_policy: Any = None
    """Which submodules become FSDP units (see :mod:`kolossos.fsdp.wrap`); ``None``: every
    transformer block of a Hugging Face model, else every top-level child with parameters."""
    backward_prefetch: bool = True
    """Prefetch the next unit's all-gather at the start of each unit's backward (FSDP1's
    ``BACKWARD_PRE``; FSDP2 always does this)."""
    forward_prefetch: bool = False
    """Issue the next unit's all-gather before the current unit's forward runs."""
    precision: str = "fp32"
    """Compute precision: ``fp32``, ``bf16`` or ``fp16`` (the last with a dynamic loss scale)."""
    param_dtype: torch.dtype | None = None
    """Dtype parameters are all-gathered in and computed with (``None``: their own)."""
    reduce_dtype: torch.dtype | None = None
    """Dtype gradients are reduce-scattered in (``None``: ``param_dtype``)."""
    output_dtype: torch.dtype | None = None
    """Dtype the root module's floating-point outputs are cast to (``None``: unchanged)."""
    cast_forward_inputs: bool = True
    """Cast each unit's floating-point inputs to ``param_dtype``."""
    buffer_dtype: torch.dtype | None = None
    """Floating-point buffers are converted to this dtype once, before sharding."""
    fp32_module_classes: tuple[type[nn.Module], ...] = ()
    """Modules of these classes become units of their own that compute in fp32 (FSDP1's
    ``MixedPrecision._module_classes_to_ignore``, e.g. BatchNorm)."""
    ignored_modules: tuple[nn.Module, ...] = ()
    """Modules FSDP leaves alone: not sharded, not moved, gradients not reduced."""
    ignored_params: tuple[nn.Parameter, ...] = ()
    """Single parameters FSDP leaves alone (FSDP1's ``ignored_states``)."""
    param_init_fn: Callable[[nn.Module], None] | None = None
    """Initialises a model built on the meta device, called once with the root module after it
    was sharded and materialised (``to_empty``); ``None``: ``reset_parameters()`` of each
    submodule that has one."""
    sync_module_states: bool = False
    """Broadcast parameters and buffers from the first data-parallel rank before sharding."""
    checkpoint_format: str = "hf"
    """``hf``: ``shard=True`` saves write Hugging Face shards / the name-keyed optimizer format
    (gathered); ``dcp``: they write ``torch.distributed.checkpoint`` directories (each rank its
    own shards)."""
    loss_scale: LossScalePolicy = field(default_factory=LossScalePolicy)
    """fp16 only: the dynamic loss-scale policy (``initial_scale=2**16`` ...)."""

    def __post_init__(self) -> None:
        if self.sharding not in SHARDING_MODES:
            raise ValueError(
                f"sharding_strategy={self.sharding!r} is not one of {', '.join(SHARDING_MODES)}."
            )
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"precision={self.precision!r} must be one of {', '.join(PRECISIONS)}."
            )
        if self.checkpoint_format not in CHECKPOINT_FORMATS:
            raise ValueError(
                f"checkpoint_format={self.checkpoint_format!r} must be 'hf' (Hugging Face files, "
                "gathered) or 'dcp' (torch.distributed.checkpoint, one file per rank)."
            )
        check_flags(
            self,
            (
                "offload_params",
                "backward_prefetch",
                "forward_prefetch",
                "cast_forward_inputs",
                "sync_module_states",
            ),
        )
        self._check_dtypes()
        if not isinstance(self.loss_scale, LossScalePolicy):
            raise TypeError(f"loss_scale={self.loss_scale!r} must be a LossScalePolicy.")
        if self.param_init_fn is not None and not callable(self.param_init_fn):
            raise TypeError(
                f"param_init_fn={self.param_init_fn!r} must be a callable taking the module."
            )
        for module in self.ignored_modules:
            if not isinstance(module, nn.Module):
                raise TypeError(f"ignored_modules holds a {type(module).__name__}, not a Module.")

    def _check_dtypes(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype", "buffer_dtype"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, torch.dtype) and value.is_floating_point
            ):
                raise TypeError(f"{name}={value!r} must be a floating-point torch.dtype or None.")
        expected = _LOW_PRECISION.get(self.precision)
        allowed = (expected,) if expected is not None else (None, torch.float32)
        if self.param_dtype not in allowed:
            raise ValueError(
                f"precision={self.precision!r} computes in {expected or torch.float32}, but "
                f"param_dtype={self.param_dtype}; make them agree (e.g. precision='bf16' with "
                "MixedPrecision(param_dtype=torch.bfloat16))."
            )

    # --- derived values -------------------------------------------------------------------
    @property
    def hybrid(self) -> bool:
        """Whether parameters are replicated across one mesh dimension (2-D mesh)."""
        return self.sharding in ("NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")

    @property
    def reshard_after_forward(self) -> bool:
        """Whether non-root units free their gathered parameters after forward (ZeRO-3)."""
        return self.sharding in ("FULL_SHARD", "HYBRID_SHARD")

    @property
    def loss_scaled(self) -> bool:
        """Whether gradients need a dynamic loss scale (fp16 compute)."""
        return self.param_dtype == torch.float16
