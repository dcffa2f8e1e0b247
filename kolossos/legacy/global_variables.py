"""Colossal-AI's legacy process-wide settings: ``tensor_parallel_env``, written by the
process-group initializers and read by the legacy tensor-parallel layers, and ``moe_env``, the
MoE settings (:data:`kolossos.moe.MOE_CONTEXT`)."""

from __future__ import annotations

from typing import Any

from kolossos.moe.context import MOE_CONTEXT as moe_env

__all__ = ["TensorParallelEnv", "moe_env", "tensor_parallel_env"]


class TensorParallelEnv:
    """The tensor-parallel mode and its grid sizes (one instance per process).

    Example:
        >>> env = TensorParallelEnv()
        >>> env.load(mode="2d", summa_dim=2)
        >>> env.save()["summa_dim"]
        2
    """

    def __init__(self, **kwargs: Any) -> None:
        self.load(**kwargs)

    def load(
        self,
        mode: str | None = None,
        vocab_parallel: bool = False,
        parallel_input_1d: bool = False,
        summa_dim: int | None = None,
        tesseract_dim: int | None = None,
        tesseract_dep: int | None = None,
        depth_3d: int | None = None,
        input_group_3d: Any = None,
        weight_group_3d: Any = None,
        output_group_3d: Any = None,
        input_x_weight_group_3d: Any = None,
        output_x_weight_group_3d: Any = None,
    ) -> None:
        """Set every field (the ones not given go back to their defaults)."""
        self.mode = mode
        self.vocab_parallel = vocab_parallel
        self.parallel_input_1d = parallel_input_1d
        self.summa_dim = summa_dim
        self.tesseract_dim = tesseract_dim
        self.tesseract_dep = tesseract_dep
        self.depth_3d = depth_3d
        self.input_group_3d = input_group_3d
        self.weight_group_3d = weight_group_3d
        self.output_group_3d = output_group_3d
        self.input_x_weight_group_3d = input_x_weight_group_3d
        self.output_x_weight_group_3d = output_x_weight_group_3d

    def save(self) -> dict[str, Any]:
        """Every field as a dict (``load(**env.save())`` restores them)."""
        return dict(vars(self))


#: the process's settings (Colossal-AI's ``colossalai.global_variables.tensor_parallel_env``)
tensor_parallel_env = TensorParallelEnv()
