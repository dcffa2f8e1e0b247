"""``InferenceConfig``: how the inference engine places and batches a model, validated."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["InferenceConfig"]


@dataclass(frozen=True, kw_only=True)
class InferenceConfig:
    """Engine settings (Colossal-AI 0.4's ``InferenceConfig`` names, the subset built so far).

    Example:
        >>> InferenceConfig(tp_size=2, max_batch_size=4)
        InferenceConfig(tp_size=2, pp_size=1, max_batch_size=4)
    """

    tp_size: int = 1
    """Ranks one model replica is split over (tensor parallelism). The world size must be a
    multiple of it; consecutive ranks form a group, and each group generates on its own."""
    pp_size: int = 1
    """Pipeline stages, each holding a contiguous part of the decoder blocks (and their part of
    the KV cache). With ``tp_size > 1`` each stage is split over ``tp_size`` consecutive ranks:
    ``tp_size * pp_size`` ranks form one replica."""
    max_batch_size: int = 8
    """The most sequences one ``generate`` call takes."""

    def __post_init__(self) -> None:
        for name in ("tp_size", "pp_size", "max_batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"InferenceConfig.{name}={value!r} must be an int >= 1.")
