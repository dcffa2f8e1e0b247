"""Colossal-AI's activation-checkpointing configs: how many transformer layers recompute their
activations in backward instead of keeping them.

``GradientCheckpointConfig(gradient_checkpointing_ratio=r)`` checkpoints ``int(r * n)`` of the
``n`` blocks (of the whole model, or of each pipeline stage); ``PipelineGradientCheckpointConfig``
can instead give an explicit count per (virtual) pipeline stage. The first blocks of a stage are
the ones checkpointed, as upstream does. Colossal-AI 0.4's names and fields.

Example:
    >>> plugin = HybridParallelPlugin(  # doctest: +SKIP
    ...     tp_size=2, gradient_checkpoint_config=GradientCheckpointConfig(
    ...         gradient_checkpointing_ratio=0.5))
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["GradientCheckpointConfig", "PipelineGradientCheckpointConfig"]


@dataclass
class GradientCheckpointConfig:
    """Checkpoint a fraction of the transformer blocks.

    Raises:
        ValueError: the ratio is not a number in ``[0, 1]``.
    """

    gradient_checkpointing_ratio: float = 0.0
    """Fraction of the blocks (of the model, or of each pipeline stage) that recompute their
    activations in backward; ``int(ratio * num_layers)`` blocks, the first ones."""

    def __post_init__(self) -> None:
        ratio = self.gradient_checkpointing_ratio
        if (
            isinstance(ratio, bool)
            or not isinstance(ratio, (int, float))
            or not math.isfinite(ratio)
            or not 0 <= ratio <= 1
        ):
            raise ValueError(
                f"gradient_checkpointing_ratio={ratio!r} must be a number in [0, 1] (the "
                "fraction of transformer layers to recompute), e.g. 0.5."
            )

    def get_num_ckpt_layers(self, num_layers: int) -> int:
        """How many of ``num_layers`` blocks are checkpointed."""
        return int(self.gradient_checkpointing_ratio * num_layers)


@dataclass
class PipelineGradientCheckpointConfig(GradientCheckpointConfig):
    """Checkpointed blocks per pipeline stage: ``num_ckpt_layers_per_stage`` (one count per
    virtual stage, stage ``s`` of model chunk ``c`` at index ``s + c * num_stages``) takes
    precedence over the ratio. Without pipeline parallelism the model is one stage.

    Raises:
        ValueError: a negative or non-integer count, or a bad ratio.
    """

    num_ckpt_layers_per_stage: list[int] | None = None
    """Checkpointed blocks of each virtual stage (``None``: use the ratio)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        counts = self.num_ckpt_layers_per_stage
        if counts is None:
            return
        if (
            not isinstance(counts, (list, tuple))
            or not counts
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in counts)
        ):
            raise ValueError(
                f"num_ckpt_layers_per_stage={counts!r} must be None or a non-empty list of ints "
                ">= 0, one per (virtual) pipeline stage."
            )

    def get_num_ckpt_layers(  # type: ignore[override]
        self,
        stage: int = 0,
        num_stages: int = 1,
        num_layers: int = 0,
        model_chunk_id: int = 0,
        num_model_chunks: int = 1,
    ) -> int:
        """Checkpointed blocks of stage ``stage`` (chunk ``model_chunk_id``) holding
        ``num_layers`` blocks.

        Raises:
            ValueError: the per-stage list does not have ``num_stages * num_model_chunks``
                entries, or asks for more blocks than the stage holds.
        """
        counts = self.num_ckpt_layers_per_stage
        if counts is None:
            return int(self.gradient_checkpointing_ratio * num_layers)
        if len(counts) != num_stages * num_model_chunks:
            raise ValueError(
                f"num_ckpt_layers_per_stage has {len(counts)} entries but the pipeline has "
                f"{num_stages} stages x {num_model_chunks} model chunks; give one count per "
                "virtual stage."
            )
        count = counts[stage + model_chunk_id * num_stages]
        if count > num_layers:
            raise ValueError(
                f"num_ckpt_layers_per_stage asks for {count} checkpointed layers on stage "
                f"{stage} (chunk {model_chunk_id}), which holds only {num_layers}; lower it."
            )
        return count
