"""Colossal-AI's ``ParallelModule``: the base of the tensor-parallel layers, here kolossos'
:class:`~kolossos.nn.layer.parallel_1d.ParallelModule1D` (the same class), so
``isinstance(layer, ParallelModule)`` holds for every 1D layer and dropout.

Unlike Colossal-AI's, its ``state_dict`` holds this rank's shards (checkpoint IO gathers them with
each parameter's ``TPShardSpec``), and subclasses are not forced to define
``from_native_module``.
"""

from kolossos.nn.layer.parallel_1d import ParallelModule1D as ParallelModule

__all__ = ["ParallelModule"]
