"""Tensor-parallel layers.

* :mod:`kolossos.nn.layer.parallel_1d`: Megatron 1D layers built from native modules (what the
  shardformer plans and the hybrid-parallel plugin use).
* :mod:`kolossos.nn.layer.legacy`: Colossal-AI's config-driven ``kolossos.nn.Linear`` /
  ``Dropout`` / ``Embedding`` / ``LayerNorm``, which read ``parallel.tensor`` from the launch
  config and dispatch to the 1D layers (or plain torch layers without tensor parallelism).
"""
