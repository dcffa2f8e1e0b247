"""The pieces :class:`~kolossos.booster.plugin.HybridParallelPlugin` composes: its validated
config, the (dp, pp, tp) mesh, the model wrappers, the pipeline runtime, TP-aware optimizers
(clipping by the whole model's norm, mixed precision with fp32 masters, LowLevelZero over the
data-parallel axis) and the sequence-parallel gradient sum."""

from kolossos.booster.plugin.hybrid.config import HybridParallelConfig, check_world
from kolossos.booster.plugin.hybrid.grad_norm import tp_global_norm
from kolossos.booster.plugin.hybrid.mesh import HybridMesh, build_mesh, mesh_layout
from kolossos.booster.plugin.hybrid.model import HybridParallelModule, HybridPipelineModule
from kolossos.booster.plugin.hybrid.optimizer import TPMixedPrecisionOptimizer, TPOptimizer
from kolossos.booster.plugin.hybrid.zero_optimizer import HybridZeroOptimizer

__all__ = [
    "HybridMesh",
    "HybridParallelConfig",
    "HybridParallelModule",
    "HybridPipelineModule",
    "HybridZeroOptimizer",
    "TPMixedPrecisionOptimizer",
    "TPOptimizer",
    "build_mesh",
    "check_world",
    "mesh_layout",
    "tp_global_norm",
]
