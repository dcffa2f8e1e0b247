"""Step schedules (``colossalai.engine.schedule``): :class:`NonPipelineSchedule`, and
:class:`BaseSchedule` to write your own. The pipeline schedules are not provided yet (use
``HybridParallelPlugin(pp_size=...)`` with the Booster meanwhile)."""

from kolossos.legacy.engine.schedule.base import BaseSchedule
from kolossos.legacy.engine.schedule.non_pipeline import NonPipelineSchedule

__all__ = ["BaseSchedule", "NonPipelineSchedule"]
