"""Colossal-AI's old import path ``colossalai.global_variables``."""

from kolossos.legacy.global_variables import TensorParallelEnv, tensor_parallel_env

__all__ = ["TensorParallelEnv", "tensor_parallel_env"]
