"""Colossal-AI's ``colossalai.shardformer.layer.linear``: the column- and row-parallel linear
layers, which are kolossos' own (:mod:`kolossos.nn.layer.parallel_1d.linear`, the same classes)."""

from kolossos.nn.layer.parallel_1d.linear import Linear1D_Col, Linear1D_Row

__all__ = ["Linear1D_Col", "Linear1D_Row"]
