"""The hybrid engine: tensor parallelism (+ sequence parallelism) and pipeline parallelism
combined with data parallelism (DDP or ZeRO-1/2) over a ``(dp, pp, tp)`` process mesh —
what :class:`~kolossos.booster.plugin.HybridParallelPlugin` composes.

Modules, by concept: ``config`` (the validated configuration), ``mesh`` (the process mesh),
``sharding`` (the tensor-parallel plan applied, the optimizer re-pointed), ``model`` (the model
wrappers), ``grad_norm`` / ``tp_state`` / ``optimizer`` / ``zero_optimizer`` (TP-aware
optimizers), ``pipeline_runtime`` (stages, tied parameters, a pipelined step), ``engine`` (the
composition), ``checkpoint_io`` / ``pipeline_checkpoint_io`` / ``stage_transport`` (checkpoints).
See ``docs/tensor_parallel.md`` and ``docs/pipeline.md``.
"""

from kolossos.hybrid.config import HybridParallelConfig, check_world
from kolossos.hybrid.engine import HybridParallelEngine, build_optimizer
from kolossos.hybrid.grad_norm import tp_global_norm
from kolossos.hybrid.mesh import HybridMesh, build_mesh, mesh_layout
from kolossos.hybrid.model import HybridParallelModule, HybridPipelineModule
from kolossos.hybrid.optimizer import HybridOptimizer, TPMixedPrecisionOptimizer, TPOptimizer
from kolossos.hybrid.zero_optimizer import HybridZeroOptimizer

__all__ = [
    "HybridMesh",
    "HybridOptimizer",
    "HybridParallelConfig",
    "HybridParallelEngine",
    "HybridParallelModule",
    "HybridPipelineModule",
    "HybridZeroOptimizer",
    "TPMixedPrecisionOptimizer",
    "TPOptimizer",
    "build_mesh",
    "build_optimizer",
    "check_world",
    "mesh_layout",
    "tp_global_norm",
]
