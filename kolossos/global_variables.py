"""Colossal-AI's old import path ``colossalai.global_variables``."""

from kolossos.legacy.global_variables import TensorParallelEnv, moe_env, tensor_parallel_env

__all__ = ["TensorParallelEnv", "moe_env", "tensor_parallel_env"]
