"""Colossal-AI's ``colossalai.shardformer.layer.embedding``: kolossos' tensor-parallel
embeddings (:mod:`kolossos.nn.layer.parallel_1d.embedding`, the same classes)."""

from kolossos.nn.layer.parallel_1d.embedding import Embedding1D, VocabParallelEmbedding1D

__all__ = ["Embedding1D", "VocabParallelEmbedding1D"]
