"""``MoeHybridParallelConfig``: the validated arguments of
:class:`~kolossos.booster.plugin.MoeHybridParallelPlugin`.

The hybrid engine's configuration plus ``ep_size``: an expert-parallel axis carved out of data
parallelism (``dp = ep x moe_dp``). Blocks of ``ep_size`` consecutive ranks share one copy of
the experts (each holds ``E / ep_size`` of them); the ranks at the same place of every block
form an expert's data-parallel group (:mod:`kolossos.moe.parallel_info`). What this version
composes expert parallelism with is checked here (before any collective); the sizes that need
the world size are checked by :func:`check_moe_world`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kolossos.hybrid.config import HybridParallelConfig, check_world

__all__ = ["MoeHybridParallelConfig", "check_moe_world"]


@dataclass(frozen=True, kw_only=True)
class MoeHybridParallelConfig(HybridParallelConfig):
    """:class:`~kolossos.hybrid.HybridParallelConfig` with an expert-parallel size.

    Example:
        >>> MoeHybridParallelConfig(ep_size=2, precision="fp32").ep_size
        2
    """

    tp_size: int = 1
    """Tensor-parallel size (only 1 with expert parallelism in this version)."""
    ep_size: int = 1
    """Ranks one layer's experts are spread over (consecutive ranks, inside data parallelism)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.ep_size, bool) or not isinstance(self.ep_size, int) or self.ep_size < 1:
            raise ValueError(f"ep_size={self.ep_size!r} must be an int >= 1.")
        if self.tp_size > 1:
            raise NotImplementedError(
                f"tp_size={self.tp_size} with ep_size={self.ep_size}: MoeHybridParallelPlugin "
                "does not combine tensor parallelism with expert parallelism (as Colossal-AI "
                "documents); set tp_size=1, or use HybridParallelPlugin for a dense model."
            )
        if self.sp_axis_size > 1 or self.enable_sequence_parallelism:
            raise NotImplementedError(
                "enable_sequence_parallelism=True with MoeHybridParallelPlugin: sequence "
                "parallelism of expert-parallel models is not implemented; leave it False."
            )
        if self.zero_stage > 0 and self.precision == "fp16":
            raise NotImplementedError(
                f"precision='fp16' with zero_stage={self.zero_stage} and expert parallelism: "
                "the dense and expert ZeRO partitions would need one shared loss scale; use "
                "precision='bf16' or 'fp32' (or zero_stage=0)."
            )
        if self.overlap_allgather:
            raise NotImplementedError(
                "overlap_allgather=True with MoeHybridParallelPlugin is not implemented; leave "
                "it False."
            )


def check_moe_world(config: MoeHybridParallelConfig, world_size: int) -> int:
    """The expert data-parallel size ``dp / ep`` for ``world_size`` processes.

    Raises:
        ValueError: ``ep_size x pp_size x tp_size`` does not divide ``world_size``.
    """
    parallel = config.ep_size * config.pp_size * config.tp_size
    if world_size % parallel:
        raise ValueError(
            f"the world size {world_size} is not divisible by ep_size * pp_size * tp_size = "
            f"{config.ep_size} * {config.pp_size} * {config.tp_size}; choose sizes whose "
            "product divides the number of processes (the rest is expert data parallelism)."
        )
    return check_world(config, world_size) // config.ep_size
