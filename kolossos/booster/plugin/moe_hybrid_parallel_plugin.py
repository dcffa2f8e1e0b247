"""``MoeHybridParallelPlugin``: expert parallelism for Hugging Face Mixtral / Qwen2-MoE models,
composed with data parallelism (DDP or ZeRO-1/2).

The plugin is Colossal-AI's keyword surface over the MoE hybrid engine: its arguments become a
:class:`~kolossos.moe.hybrid_config.MoeHybridParallelConfig` and
:class:`~kolossos.moe.hybrid_engine.MoeHybridParallelEngine` does the rest (mesh and expert
groups, the expert-parallel plan, optimizers, checkpoint IO). See ``docs/moe.md``.
"""

from __future__ import annotations

from typing import Any

import torch

from kolossos.booster.plugin.dp_plugin_base import DPPluginBase, _require_process_group
from kolossos.booster.plugin.hybrid_parallel_plugin import HybridParallelPlugin
from kolossos.booster.plugin.plugin_base import config_from_arguments
from kolossos.moe.hybrid_config import MoeHybridParallelConfig
from kolossos.moe.hybrid_engine import MoeHybridParallelEngine
from kolossos.moe.parallel_info import MoeParallelInfo

__all__ = ["MoeHybridParallelPlugin"]


class MoeHybridParallelPlugin(HybridParallelPlugin):
    """Expert parallelism over ``ep_size`` consecutive ranks inside data parallelism.

    ``dp_size = world_size / (tp_size * pp_size)`` and ``dp_size = ep_size * moe_dp_size``:
    each block of ``ep_size`` consecutive ranks holds one copy of every layer's experts
    (``num_experts / ep_size`` per rank), the ranks at the same place of every block share an
    expert's gradient. Dense parameters are reduced over the whole data-parallel group, expert
    parameters over their expert data-parallel group; ZeRO-1/2 partitions each over its own
    group. The model's sparse MoE blocks (Mixtral, Qwen2-MoE) are replaced by expert-parallel
    blocks computing the same function (Hugging Face routing, no token dropped).

    This version composes expert parallelism with data parallelism and ZeRO-1/2 in fp32 / bf16
    (fp16 with DDP), with pipeline stages for Mixtral (``booster.execute_pipeline``; the
    expert-parallel groups lie inside each stage's data-parallel ranks), clipping by the global
    norm (``max_norm``) and name-keyed optimizer checkpoints that reload at another ``ep_size``
    (``pp_size=1``); ``tp_size > 1``, sequence parallelism, checkpoints with ``pp_size > 1`` and
    ``output_router_logits=True`` with ``pp_size > 1`` raise ``NotImplementedError`` naming the
    option.

    Args: see :class:`~kolossos.moe.hybrid_config.MoeHybridParallelConfig` (Colossal-AI's
        names; ``tp_size`` / ``pp_size`` / ``ep_size`` in Colossal-AI's positional order).

    Raises:
        ValueError / TypeError: a bad argument, or ``ep_size * pp_size * tp_size`` not dividing
            the world size; at ``boost``, a number of experts not divisible by ``ep_size``.
        NotImplementedError: an option this implementation does not provide (named).

    Example:
        >>> plugin = MoeHybridParallelPlugin(ep_size=2, zero_stage=1, precision="bf16")
        ... # doctest: +SKIP
        >>> booster = Booster(plugin=plugin)  # doctest: +SKIP
        >>> model, optimizer, *_ = booster.boost(mixtral, optimizer)  # doctest: +SKIP
    """

    config_factory = MoeHybridParallelConfig

    def __init__(
        self,
        tp_size: int = 1,
        pp_size: int = 1,
        ep_size: int = 1,
        sp_size: int | None = None,
        precision: str = "fp16",
        zero_stage: int = 0,
        enable_all_optimization: bool = False,
        enable_fused_normalization: bool = False,
        enable_flash_attention: bool = False,
        enable_jit_fused: bool = False,
        enable_sequence_parallelism: bool = False,
        sequence_parallelism_mode: str | None = None,
        parallel_output: bool = True,
        num_microbatches: int | None = None,
        microbatch_size: int | None = None,
        initial_scale: float = 2**16,
        min_scale: float = 1,
        growth_factor: float = 2,
        backoff_factor: float = 0.5,
        growth_interval: int = 1000,
        hysteresis: int = 2,
        max_scale: float = 2**32,
        max_norm: float = 0,
        broadcast_buffers: bool = True,
        ddp_bucket_cap_mb: float = 25,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        zero_bucket_size_in_m: float = 12,
        cpu_offload: bool = False,
        communication_dtype: torch.dtype | None = None,
        overlap_communication: bool = True,
        custom_policy: Any = None,
        pp_style: str = "1f1b",
        num_model_chunks: int = 1,
        num_layers_per_stage: list[int] | None = None,
        gradient_checkpoint_config: Any = None,
        enable_metadata_cache: bool = True,
        make_vocab_size_divisible_by: int = 64,
        moe_dp_outside: bool = True,
        overlap_p2p: bool = True,
        overlap_allgather: bool = False,
        fp8_communication: bool = False,
        use_fp8: bool = False,
    ) -> None:
        unsupported = {
            "moe_dp_outside=False": not moe_dp_outside,
            "fp8_communication=True": fp8_communication,
            "use_fp8=True": use_fp8,
        }
        for given, used in unsupported.items():
            if used:
                raise NotImplementedError(
                    f"{given} is not implemented by MoeHybridParallelPlugin (expert groups are "
                    "consecutive ranks inside data parallelism); leave the default."
                )
        arguments = dict(locals())
        for name in ("moe_dp_outside", "fp8_communication", "use_fp8", "unsupported", "given"):
            arguments.pop(name, None)
        arguments.pop("used", None)
        config = config_from_arguments(MoeHybridParallelConfig, arguments)
        _require_process_group(type(self).__name__)
        self.config = config
        self.moe_engine = MoeHybridParallelEngine(config)  # collective: mesh and expert groups
        self.engine = self.moe_engine
        DPPluginBase.__init__(self, self.engine.mesh.dp_group)

    @property
    def ep_size(self) -> int:
        """Expert-parallel size."""
        return self.moe_engine.moe_config.ep_size

    @property
    def moe_info(self) -> MoeParallelInfo:
        """This rank's expert-parallel layout (groups, rank, expert DP size)."""
        return self.moe_engine.moe_info

    def support_pipeline(self) -> bool:
        return self.config.pp_size > 1

    def __repr__(self) -> str:
        m = self.mesh
        return (
            f"MoeHybridParallelPlugin(ep_size={self.ep_size}, tp_size={m.tp_size}, "
            f"pp_size={m.pp_size}, dp_size={m.dp_size}, precision={self.config.precision!r}, "
            f"zero_stage={self.config.zero_stage})"
        )
