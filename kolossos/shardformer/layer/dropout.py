"""Colossal-AI's ``colossalai.shardformer.layer.dropout``: kolossos' tensor-parallel dropouts
(:mod:`kolossos.nn.layer.parallel_1d.dropout`, the same classes)."""

from kolossos.nn.layer.parallel_1d.dropout import (
    DropoutForParallelInput,
    DropoutForReplicatedInput,
)

__all__ = ["DropoutForParallelInput", "DropoutForReplicatedInput"]
