"""Tensor-parallel layers.

* :mod:`kolossos.nn.layer.parallel_1d`: Megatron 1D layers built from native modules (what the
  shardformer plans and the hybrid-parallel plugin use).

Colossal-AI's config-driven ``kolossos.nn.Linear`` / ``Dropout`` / ``Embedding`` / ``LayerNorm``
read the launch config, so they belong to the legacy API:
:mod:`kolossos.legacy.nn.layer.colossalai_layer` (``kolossos.nn`` re-exports them lazily).
"""
