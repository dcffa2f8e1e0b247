"""``PipelineStageManager``: this process's place in its pipeline (the pipeline axis of a
:class:`~kolossos.cluster.ProcessGroupMesh`), its virtual stages, and its neighbours."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup

from kolossos.cluster import ProcessGroupMesh
from kolossos.pipeline import layout as _layout
from kolossos.pipeline.partition import bounds_from_counts, per_rank, uniform_bounds


class PipelineStageManager:
    """The pipeline axis of a process mesh, seen from one rank.

    Ranks along ``pipeline_axis`` form one pipeline; the other axes (data, tensor parallel...)
    replicate it. With ``num_model_chunks > 1`` each rank holds several virtual stages, placed
    by ``layout`` (``"loop"`` for interleaved 1F1B, ``"v"`` for ZB-V).

    Args:
        pg_mesh: a :class:`~kolossos.cluster.ProcessGroupMesh`; ``None``: all processes of the
            job form one pipeline.
        pipeline_axis: the pipeline axis (index or name).
        num_model_chunks: model chunks (virtual stages) per rank.
        layout: ``"loop"`` or ``"v"`` (:mod:`kolossos.pipeline.layout`).

    Raises:
        RuntimeError: torch.distributed is not initialised and ``pg_mesh`` is ``None``.
        ValueError: a bad chunk count or layout.

    Example:
        >>> mesh = ProcessGroupMesh(2, 4, axis_names=("dp", "pp"))  # doctest: +SKIP
        >>> manager = PipelineStageManager(mesh, "pp", num_model_chunks=2)  # doctest: +SKIP
        >>> manager.stage, manager.is_first_stage(), manager.stage_index(1)  # doctest: +SKIP
        (0, True, 4)
    """

    def __init__(
        self,
        pg_mesh: Any | None = None,
        pipeline_axis: int | str = 0,
        *,
        num_model_chunks: int = 1,
        layout: str = "loop",
    ) -> None:
        if pg_mesh is None:
            if not dist.is_initialized():
                raise RuntimeError(
                    "PipelineStageManager needs torch.distributed; call kolossos.launch_from_torch"
                    "() first, or pass a ProcessGroupMesh."
                )
            pg_mesh = ProcessGroupMesh(dist.get_world_size(), axis_names=("pp",))
            pipeline_axis = "pp"
        size = pg_mesh.size(pipeline_axis)
        assert isinstance(size, int)
        _layout.check_layout(size, num_model_chunks, layout)
        self.pg_mesh = pg_mesh
        self.pipeline_axis = pipeline_axis
        self.pp_size: int = size
        self.num_model_chunks = num_model_chunks
        self.layout = layout
        self.stage: int = int(pg_mesh.coordinate(pipeline_axis))  # type: ignore[arg-type]
        self.ranks: list[int] = pg_mesh.ranks_along_axis(pipeline_axis)
        """global ranks of this pipeline, by pipeline position"""

    @classmethod
    def default(cls, num_model_chunks: int = 1, layout: str = "loop") -> PipelineStageManager:
        """All processes as one pipeline; a single-stage stand-in without torch.distributed."""
        if dist.is_initialized():
            return cls(num_model_chunks=num_model_chunks, layout=layout)
        return _SingleProcess(num_model_chunks, layout)

    @property
    def num_stages(self) -> int:
        """Pipeline ranks (Colossal-AI's name for the pipeline size)."""
        return self.pp_size

    @property
    def num_virtual_stages(self) -> int:
        """Virtual stages of the whole pipeline (ranks x chunks)."""
        return self.pp_size * self.num_model_chunks

    @property
    def group(self) -> ProcessGroup:
        """The pipeline's process group (point-to-point traffic goes through it)."""
        group: ProcessGroup = self.pg_mesh.get_group_along_axis(self.pipeline_axis)
        return group

    def stage_index(self, chunk: int = 0, stage: int | None = None) -> int:
        """Virtual stage index of ``chunk`` on pipeline position ``stage`` (default: this one)."""
        pos = self.stage if stage is None else stage
        return _layout.stage_of(pos, chunk, self.pp_size, self.num_model_chunks, self.layout)

    def owner(self, virtual_stage: int) -> tuple[int, int]:
        """``(pipeline position, chunk)`` holding a virtual stage."""
        return _layout.owner_of(virtual_stage, self.pp_size, self.num_model_chunks, self.layout)

    def global_rank(self, position: int) -> int:
        """The global rank at pipeline position ``position`` of this pipeline."""
        return self.ranks[position]

    def is_first_stage(self, chunk: int | None = None) -> bool:
        """Whether ``chunk`` here is the first virtual stage; with ``chunk=None``, whether this
        rank is pipeline position 0."""
        if chunk is None:
            return self.stage == 0
        return self.stage_index(chunk) == 0

    def is_last_stage(self, chunk: int | None = None) -> bool:
        """Whether ``chunk`` here is the last virtual stage; with ``chunk=None``, whether this
        rank is the last pipeline position."""
        if chunk is None:
            return self.stage == self.pp_size - 1
        return self.stage_index(chunk) == self.num_virtual_stages - 1

    @property
    def prev_rank(self) -> int:
        """Global rank of the previous pipeline position (wrapping around)."""
        return self.ranks[(self.stage - 1) % self.pp_size]

    @property
    def next_rank(self) -> int:
        """Global rank of the next pipeline position (wrapping around)."""
        return self.ranks[(self.stage + 1) % self.pp_size]

    def distribute_layers(self, num_layers: int) -> list[int]:
        """Layers per virtual stage for a uniform split of ``num_layers`` repeated blocks (the
        last stages take the remainder), in data-flow order.

        Raises:
            ValueError: fewer layers than virtual stages.
        """
        if num_layers < self.num_virtual_stages:
            raise ValueError(
                f"{num_layers} layers cannot fill {self.num_virtual_stages} pipeline stages; use "
                "fewer stages or chunks."
            )
        return [end - start for start, end in uniform_bounds(num_layers, self.num_virtual_stages)]

    def get_stage_index(
        self, layers_per_stage: Sequence[int], stage: int | None = None
    ) -> list[tuple[int, int]]:
        """The ``(start, end)`` layer range of each chunk on pipeline position ``stage``
        (default: this one), from per-virtual-stage layer counts.

        Raises:
            ValueError: counts that are not one positive number per virtual stage.
        """
        if len(layers_per_stage) != self.num_virtual_stages:
            raise ValueError(
                f"layers_per_stage has {len(layers_per_stage)} entries for "
                f"{self.num_virtual_stages} virtual stages; give one count per stage."
            )
        bounds = bounds_from_counts(layers_per_stage, sum(layers_per_stage))
        parts = per_rank(bounds, self.pp_size, self.num_model_chunks, self.layout)
        return parts[self.stage if stage is None else stage]

    def __repr__(self) -> str:
        return (
            f"PipelineStageManager(position {self.stage} of {self.pp_size}, "
            f"{self.num_model_chunks} chunk(s), layout {self.layout!r})"
        )


class _SingleProcess(PipelineStageManager):
    """A one-stage pipeline without a process group (building or testing in one process)."""

    def __init__(self, num_model_chunks: int, layout: str) -> None:  # no super(): no mesh
        _layout.check_layout(1, num_model_chunks, layout)
        self.pg_mesh = None
        self.pipeline_axis = 0
        self.pp_size = 1
        self.num_model_chunks = num_model_chunks
        self.layout = layout
        self.stage = 0
        self.ranks = [0]
