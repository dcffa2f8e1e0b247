"""``ShardConfig``: what :class:`~kolossos.shardformer.ShardFormer` does to a model, validated."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup

from kolossos.shardformer.grad_ckpt_config import GradientCheckpointConfig

__all__ = ["SEQUENCE_PARALLELISM_MODES", "ShardConfig"]

SEQUENCE_PARALLELISM_MODES = ("split_gather", "ring")
"""Sequence-parallel modes ShardFormer implements: Megatron sequence parallelism, its
communication as collectives (``'split_gather'``) or as ring exchanges overlapped with the
matmuls (``'ring'``, :mod:`kolossos.nn.layer.parallel_1d.ring_ops`)."""

_OTHER_MODES = ("all_to_all", "ring_attn")
"""Colossal-AI's attention-level modes: not ShardFormer's ('all_to_all' and 'ring_attn' run
through ``HybridParallelPlugin(sp_size=...)``, :mod:`kolossos.hybrid.sequence_parallel`)."""


_BOOL_FIELDS = (
    "enable_tensor_parallelism",
    "enable_sequence_parallelism",
    "enable_sequence_overlap",
    "enable_fused_normalization",
    "enable_flash_attention",
    "enable_jit_fused",
    "enable_all_optimization",
    "inference_only",
    "inference_gptq",
    "parallel_output",
)

_ALL_OPTIMIZATIONS = ("enable_fused_normalization", "enable_flash_attention", "enable_jit_fused")
"""What ``enable_all_optimization`` switches on."""

_UNSUPPORTED = {
    "inference_only": "kolossos has no inference-only plans; leave it False (the training plans "
    "also run forward-only, e.g. under torch.no_grad()).",
    "inference_gptq": "kolossos has no GPTQ support; leave it False.",
}
"""Colossal-AI options ShardFormer recognises but does not implement, with the fix."""


@dataclass(frozen=True, kw_only=True)
class ShardConfig:
    """How to shard a model over a tensor-parallel group.

    Example:
        >>> cfg = ShardConfig(tensor_parallel_process_group=tp_group,  # doctest: +SKIP
        ...                   enable_sequence_parallelism=True)
        >>> model, shared = ShardFormer(cfg).optimize(model)  # doctest: +SKIP
    """

    tensor_parallel_process_group: ProcessGroup | None = None
    """Ranks the weights are split over; ``None``: the default (world) group."""
    pipeline_stage_manager: Any = None
    """Colossal-AI's pipeline stage manager: ShardFormer does not cut pipeline stages itself, so
    anything but ``None`` raises ``NotImplementedError`` (``HybridParallelPlugin(pp_size=...)``
    builds the stages)."""
    enable_tensor_parallelism: bool = True
    """Replace the plan's layers by tensor-parallel ones. ``False``: the model is left unsharded
    (``optimize`` still reports its tied weights)."""
    enable_sequence_parallelism: bool = False
    """Megatron sequence parallelism: between tensor-parallel regions the hidden states are split
    along the sequence over the group (needs ``enable_tensor_parallelism``)."""
    sequence_parallelism_mode: str = "split_gather"
    """``'split_gather'`` (all-gather into the column layers, reduce-scatter out of the row
    layers) or ``'ring'`` (the same sharding; both done as ring exchanges, each chunk multiplied
    as it arrives); ``'all_to_all'`` / ``'ring_attn'`` run through
    ``HybridParallelPlugin(sp_size=...)``. Read only when ``enable_sequence_parallelism`` is
    set."""
    enable_sequence_overlap: bool = False
    """``'split_gather'`` only: each region's entry keeps only the sequence shard and, in
    backward, overlaps the all-gather of the input with the input-gradient matmuls and the
    reduce-scatter of the input gradient with the weight-gradient matmuls
    (:mod:`kolossos.nn.layer.parallel_1d.seq_overlap`); the same numbers as without it. Needs
    ``enable_sequence_parallelism``."""
    enable_fused_normalization: bool = False
    """Fused norms: Hugging Face RMSNorms (LLaMA) become ``torch.nn.functional.rms_norm``;
    ``nn.LayerNorm`` already runs one fused kernel and is kept."""
    enable_flash_attention: bool = False
    """Attention through ``torch.nn.functional.scaled_dot_product_attention`` (transformers'
    ``"sdpa"`` implementation; PyTorch picks the fastest kernel for the device and inputs)."""
    enable_jit_fused: bool = False
    """Dropout + residual add of the blocks as one fused call
    (:mod:`kolossos.shardformer.modeling.jit_fused`; LLaMA has none to fuse)."""
    enable_all_optimization: bool = False
    """Switch on ``enable_fused_normalization``, ``enable_flash_attention`` and
    ``enable_jit_fused`` (Colossal-AI's switch; sequence parallelism and its overlap stay as
    given, as in Colossal-AI 0.4's code, although its docstring names them)."""
    inference_only: bool = False
    """Colossal-AI 0.3.4's inference-only plans (inference kernels, KV cache): not implemented
    (``True`` raises ``NotImplementedError``); the training plans run forward-only as well."""
    inference_gptq: bool = False
    """Colossal-AI 0.3.4's GPTQ-quantised inference: not implemented (``True`` raises
    ``NotImplementedError``)."""
    extra_kwargs: dict[str, Any] = field(default_factory=dict)
    """Colossal-AI 0.3.5+'s extra options (``inference_only``, ``quant``): none is implemented,
    so a non-empty dict raises ``NotImplementedError`` naming its keys."""
    parallel_output: bool = True
    """``True``: the LM head's logits stay split over the vocabulary and a loss requested with
    ``labels`` is a vocabulary-parallel cross-entropy (full logits are never built). ``False``:
    the logits are gathered to the full vocabulary and the model's own loss runs unchanged."""
    make_vocab_size_divisible_by: int = 64
    """The vocabulary of sharded embeddings and LM heads is padded to a multiple of this times
    the tensor-parallel size (padding rows are masked out of the loss and stripped on gather)."""
    gradient_checkpoint_config: GradientCheckpointConfig | None = None
    """Recompute the activations of the first ``int(ratio * num_layers)`` blocks (or of the
    given count, :class:`~kolossos.shardformer.PipelineGradientCheckpointConfig`) in backward;
    ``None``: keep them all."""

    def __post_init__(self) -> None:
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ShardConfig.{name}={getattr(self, name)!r} must be a bool.")
        if self.enable_all_optimization:
            for name in _ALL_OPTIMIZATIONS:  # frozen: set once, during validation
                object.__setattr__(self, name, True)
        ckpt = self.gradient_checkpoint_config
        if ckpt is not None and not isinstance(ckpt, GradientCheckpointConfig):
            raise TypeError(
                f"ShardConfig.gradient_checkpoint_config={ckpt!r} must be None or a "
                "kolossos.shardformer.GradientCheckpointConfig (or "
                "PipelineGradientCheckpointConfig), e.g. "
                "GradientCheckpointConfig(gradient_checkpointing_ratio=0.5)."
            )
        self._check_unsupported()
        self._check_sequence_parallelism()
        size = self.make_vocab_size_divisible_by
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(
                f"ShardConfig.make_vocab_size_divisible_by={size!r} must be a positive int "
                "(1: pad the vocabulary only to a multiple of the tensor-parallel size)."
            )

    def _check_unsupported(self) -> None:
        for name, why in _UNSUPPORTED.items():
            if getattr(self, name):
                raise NotImplementedError(f"ShardConfig({name}=True) is not implemented: {why}")
        if self.pipeline_stage_manager is not None:
            raise NotImplementedError(
                "ShardConfig(pipeline_stage_manager=...) is not implemented: ShardFormer shards "
                "the whole model; use HybridParallelPlugin(pp_size=...) for pipeline stages, or "
                "leave it None."
            )
        if not isinstance(self.extra_kwargs, dict):
            raise TypeError(f"ShardConfig.extra_kwargs={self.extra_kwargs!r} must be a dict.")
        if self.extra_kwargs:
            raise NotImplementedError(
                f"ShardConfig(extra_kwargs={self.extra_kwargs!r}): no extra option is implemented "
                f"(unsupported keys: {sorted(self.extra_kwargs)}); pass an empty dict."
            )

    def _check_sequence_parallelism(self) -> None:
        if not self.enable_sequence_parallelism:
            if self.enable_sequence_overlap:
                raise ValueError(
                    "ShardConfig(enable_sequence_overlap=True) needs enable_sequence_parallelism="
                    "True: it overlaps the sequence-parallel communication; set both, or leave "
                    "it False."
                )
            return
        mode = self.sequence_parallelism_mode
        if mode in _OTHER_MODES:
            raise NotImplementedError(
                f"ShardConfig(sequence_parallelism_mode={mode!r}) is not implemented in "
                "ShardFormer; use 'split_gather' (Megatron sequence parallelism over the TP "
                "group), or HybridParallelPlugin(sp_size=..., sequence_parallelism_mode="
                "'all_to_all' | 'ring_attn'), which installs those attention kernels."
            )
        if mode not in SEQUENCE_PARALLELISM_MODES:
            raise ValueError(
                f"ShardConfig.sequence_parallelism_mode={mode!r} is unknown; the supported modes "
                f"are {SEQUENCE_PARALLELISM_MODES}."
            )
        if mode == "ring" and self.enable_sequence_overlap:
            raise NotImplementedError(
                "ShardConfig(sequence_parallelism_mode='ring', enable_sequence_overlap=True): "
                "the ring already overlaps every exchange with a matmul; leave "
                "enable_sequence_overlap False, or use 'split_gather' with it."
            )
        if not self.enable_tensor_parallelism:
            raise ValueError(
                "ShardConfig(enable_sequence_parallelism=True) needs enable_tensor_parallelism="
                "True: Megatron sequence parallelism splits the sequence over the tensor-parallel "
                "group between its tensor-parallel regions."
            )

    @property
    def optimizations_requested(self) -> bool:
        """Whether any model optimisation (attention, norms, fused ops, checkpointing) is on."""
        return (
            any(getattr(self, name) for name in _ALL_OPTIMIZATIONS)
            or self.gradient_checkpoint_config is not None
        )

    @property
    def tp_group(self) -> ProcessGroup:
        """The tensor-parallel group (the world group when none was given).

        Raises:
            RuntimeError: torch.distributed is not initialised.
        """
        if not dist.is_initialized():
            raise RuntimeError(
                "ShardFormer needs torch.distributed: call kolossos.launch(...) (or "
                "torch.distributed.init_process_group) before sharding a model."
            )
        group = self.tensor_parallel_process_group
        if group is None:
            group = dist.group.WORLD
        assert group is not None
        return group

    @property
    def tp_size(self) -> int:
        """Number of ranks in :attr:`tp_group` (1 when tensor parallelism is disabled)."""
        if not self.enable_tensor_parallelism:
            return 1
        return dist.get_world_size(self.tp_group)

    @property
    def tensor_parallel_size(self) -> int:
        """Colossal-AI's name of :attr:`tp_size`."""
        return self.tp_size

    @property
    def sequence_parallel(self) -> bool:
        """Whether Megatron sequence parallelism is on."""
        return self.enable_sequence_parallelism
