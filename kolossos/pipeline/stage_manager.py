"""``PipelineStageManager``: this process's place in its pipeline (the pipeline axis of a
:class:`~kolossos.cluster.ProcessGroupMesh`), its virtual stages, and its neighbours."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup

from kolossos.cluster import ProcessGroupMesh
from kolossos.pipeline import layout as _layout
from kolossos.pipeline import stage_groups
from kolossos.pipeline.partition import bounds_from_counts, per_rank, uniform_bounds


class PipelineStageManager:
    """The pipeline axis of a process mesh, seen from one rank.

    Ranks along ``pipeline_axis`` form one pipeline; the other axes (data, tensor parallel...)
    replicate it. With ``num_model_chunks > 1`` each rank holds several virtual stages, placed
    by ``layout`` (``"loop"`` for interleaved 1F1B, ``"v"`` for ZB-V).

    Construction is collective (every process of the job builds its manager at the same time):
    with more than two pipeline positions it creates the two-rank group of each pair of
    neighbouring stages (:meth:`get_p2p_process_group`), as Colossal-AI does.

    Args:
        pg_mesh: a :class:`~kolossos.cluster.ProcessGroupMesh`; ``None``: all processes of the
            job form one pipeline.
        pipeline_axis: the pipeline axis (index or name).
        enable_interleave: Colossal-AI's switch for interleaved 1F1B (the last stage also talks
            to the first). kolossos infers it from ``num_model_chunks > 1`` as well, so it may be
            left ``False``.
        num_model_chunks: model chunks (virtual stages) per rank.
        num_layers_per_stage: layers of each virtual stage, returned by
            :meth:`distribute_layers` instead of a uniform split.
        layout: ``"loop"`` or ``"v"`` (:mod:`kolossos.pipeline.layout`).

    Raises:
        RuntimeError: torch.distributed is not initialised and ``pg_mesh`` is ``None``.
        ValueError: a bad chunk count, layout or ``num_layers_per_stage``.

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
        enable_interleave: bool = False,
        num_model_chunks: int = 1,
        num_layers_per_stage: Sequence[int] | None = None,
        *,
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
        self._init_compat(enable_interleave, num_layers_per_stage)
        self.p2p_groups: dict[tuple[int, int], ProcessGroup] = self._init_p2p_groups()
        """the two-rank group of each neighbour pair this rank belongs to, by sorted global
        ranks (see :meth:`get_p2p_process_group`)"""

    def _init_compat(self, enable_interleave: bool, counts: Sequence[int] | None) -> None:
        """Colossal-AI's attributes: ``is_interleave``, ``num_layers_per_stage``,
        ``model_chunk_id``, and the stage-group cache."""
        self.is_interleave: bool = bool(enable_interleave) or self.num_model_chunks > 1
        """whether this rank holds several chunks (or interleaving was asked for)"""
        if counts is not None:
            counts = list(counts)
            if len(counts) != self.num_virtual_stages or any(
                not isinstance(c, int) or c < 1 for c in counts
            ):
                raise ValueError(
                    f"num_layers_per_stage={counts} must hold one positive int per virtual stage "
                    f"({self.num_virtual_stages} = {self.pp_size} ranks x "
                    f"{self.num_model_chunks} chunks); fix the counts or leave it None."
                )
        self.num_layers_per_stage: list[int] | None = counts
        """explicit layers per virtual stage (``None``: :meth:`distribute_layers` splits)"""
        self.model_chunk_id: int | None = None
        """the chunk :meth:`is_first_stage` / :meth:`is_last_stage` ask about when given none
        (set by :meth:`switch_model_chunk_id`)"""
        self._stage_groups: dict[tuple[int, ...], ProcessGroup | None] = {}

    def _init_p2p_groups(self) -> dict[tuple[int, int], ProcessGroup]:
        wrap = self.is_interleave and self.layout == "loop"
        if self.pp_size == 2:  # the pipeline's own group is the pair: nothing to create
            return {(min(self.ranks), max(self.ranks)): self.group}
        groups: dict[tuple[int, int], ProcessGroup] = {}
        pipelines = stage_groups.pipelines_of(self.pg_mesh, self.pipeline_axis)
        for pair in stage_groups.neighbour_pairs(self.pp_size, wrap):
            group = stage_groups.new_stage_groups(pipelines, pair)
            if group is not None:
                a, b = (self.ranks[s] for s in pair)
                groups[(min(a, b), max(a, b))] = group
        return groups

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

    def is_first_stage(self, chunk: int | None = None, ignore_chunk: bool = False) -> bool:
        """Whether this rank holds the first stage.

        Args:
            chunk: ask about this chunk: whether it is the first virtual stage. ``None``: the
                chunk of :meth:`switch_model_chunk_id` when one is set, else whether this rank
                is pipeline position 0. A bool here is Colossal-AI's positional
                ``ignore_chunk``.
            ignore_chunk: Colossal-AI's flag: whether this rank is pipeline position 0,
                whatever the chunk.
        """
        chunk = self._chunk_asked(chunk, ignore_chunk)
        if chunk is None:
            return self.stage == 0
        return self.stage_index(chunk) == 0

    def is_last_stage(self, chunk: int | None = None, ignore_chunk: bool = False) -> bool:
        """Whether this rank holds the last stage (arguments as :meth:`is_first_stage`; with no
        chunk, whether this rank is the last pipeline position)."""
        chunk = self._chunk_asked(chunk, ignore_chunk)
        if chunk is None:
            return self.stage == self.pp_size - 1
        return self.stage_index(chunk) == self.num_virtual_stages - 1

    def _chunk_asked(self, chunk: int | bool | None, ignore_chunk: bool) -> int | None:
        if isinstance(chunk, bool):  # Colossal-AI's is_first_stage(True): ignore_chunk
            chunk, ignore_chunk = None, chunk or ignore_chunk
        if ignore_chunk:
            return None
        return self.model_chunk_id if chunk is None else chunk

    @contextlib.contextmanager
    def switch_model_chunk_id(self, model_chunk_id: int) -> Iterator[None]:
        """Within the block, :meth:`is_first_stage` and :meth:`is_last_stage` called without a
        chunk ask about ``model_chunk_id`` (Colossal-AI's interleaved stage forwards use it).

        Example:
            >>> with manager.switch_model_chunk_id(1):  # doctest: +SKIP
            ...     last = manager.is_last_stage()
        """
        old, self.model_chunk_id = self.model_chunk_id, model_chunk_id
        try:
            yield
        finally:
            self.model_chunk_id = old

    @property
    def prev_rank(self) -> int:
        """Global rank of the previous pipeline position (wrapping around)."""
        return self.ranks[(self.stage - 1) % self.pp_size]

    @property
    def next_rank(self) -> int:
        """Global rank of the next pipeline position (wrapping around)."""
        return self.ranks[(self.stage + 1) % self.pp_size]

    def get_rank(self) -> int:
        """This process's global rank."""
        return dist.get_rank() if dist.is_initialized() else self.ranks[self.stage]

    def get_prev_rank(self) -> int:
        """Global rank of the previous pipeline position (wrapping around); ``prev_rank``."""
        return self.prev_rank

    def get_next_rank(self) -> int:
        """Global rank of the next pipeline position (wrapping around); ``next_rank``."""
        return self.next_rank

    def get_p2p_process_group(self, first_rank: int, second_rank: int) -> ProcessGroup:
        """The two-rank group of neighbouring stages ``first_rank`` and ``second_rank`` (global
        ranks, either order); this rank must be one of them.

        Raises:
            ValueError: the ranks are not neighbours of this rank's pipeline (the first and the
                last position are neighbours only when interleaving in the ``loop`` layout).
        """
        key = (min(first_rank, second_rank), max(first_rank, second_rank))
        if key not in self.p2p_groups:
            raise ValueError(
                f"ranks {first_rank} and {second_rank} have no point-to-point group on rank "
                f"{self.get_rank()}; the groups here are {sorted(self.p2p_groups)} (neighbouring "
                "pipeline positions including this rank; first and last too when interleaving)."
            )
        return self.p2p_groups[key]

    def init_process_group_by_stages(self, stages: list[int]) -> ProcessGroup | None:
        """The group of the ranks at pipeline positions ``stages`` (created on first request,
        for every pipeline of the mesh, then cached).

        Collective on first request: every process of the job calls it with the same stages in
        the same order. Returns ``None`` on ranks whose position is not among ``stages``.

        Raises:
            ValueError: a position outside ``[0, pp_size)``, or a repeated one.

        Example:
            >>> ends = [0, manager.num_stages - 1]
            >>> group = manager.init_process_group_by_stages(ends)  # doctest: +SKIP
        """
        key = tuple(sorted(stages))
        if len(set(key)) != len(key) or any(not 0 <= s < self.pp_size for s in key):
            raise ValueError(
                f"stages={list(stages)} must be distinct pipeline positions in "
                f"[0, {self.pp_size}); give each position once."
            )
        if key not in self._stage_groups:
            if len(key) == self.pp_size:
                self._stage_groups[key] = self.group
            else:
                pipelines = stage_groups.pipelines_of(self.pg_mesh, self.pipeline_axis)
                self._stage_groups[key] = stage_groups.new_stage_groups(pipelines, key)
        return self._stage_groups[key]

    def distribute_layers(
        self,
        num_layers: int,
        num_stages: int | None = None,
        num_model_chunks: int | None = None,
    ) -> list[int]:
        """Layers per virtual stage, in data-flow order: ``num_layers_per_stage`` when the
        manager was given it, else a uniform split of ``num_layers`` repeated blocks (the last
        stages take the remainder).

        Args:
            num_layers: the blocks to split.
            num_stages: pipeline positions (default: this pipeline's).
            num_model_chunks: chunks per position (default: this manager's).

        Raises:
            ValueError: fewer layers than virtual stages, or ``num_layers_per_stage`` that does
                not add up to ``num_layers``.
        """
        if self.num_layers_per_stage is not None:
            if sum(self.num_layers_per_stage) != num_layers:
                raise ValueError(
                    f"num_layers_per_stage={self.num_layers_per_stage} adds up to "
                    f"{sum(self.num_layers_per_stage)}, not the model's {num_layers} layers; "
                    "fix the counts given to PipelineStageManager."
                )
            return list(self.num_layers_per_stage)
        stages = (num_stages or self.pp_size) * (num_model_chunks or self.num_model_chunks)
        if num_layers < stages:
            raise ValueError(
                f"{num_layers} layers cannot fill {stages} pipeline stages; use fewer stages or "
                "chunks."
            )
        return [end - start for start, end in uniform_bounds(num_layers, stages)]

    def get_stage_index(
        self,
        layers_per_stage: Sequence[int],
        stage: int | None = None,
        num_model_chunks: int | None = None,
        num_stages: int | None = None,
    ) -> list[tuple[int, int]]:
        """The ``(start, end)`` layer range of each chunk on pipeline position ``stage``
        (default: this one), from per-virtual-stage layer counts.

        Args:
            layers_per_stage: layers of each virtual stage, in data-flow order.
            stage: the pipeline position (default: this rank's).
            num_model_chunks: chunks per position (default: this manager's).
            num_stages: pipeline positions (default: this pipeline's).

        Returns:
            One range per chunk, always a list (Colossal-AI returns a bare pair for one chunk).

        Raises:
            ValueError: counts that are not one positive number per virtual stage.
        """
        chunks = num_model_chunks or self.num_model_chunks
        positions = num_stages or self.pp_size
        if len(layers_per_stage) != positions * chunks:
            raise ValueError(
                f"layers_per_stage has {len(layers_per_stage)} entries for {positions * chunks} "
                "virtual stages; give one count per stage."
            )
        bounds = bounds_from_counts(layers_per_stage, sum(layers_per_stage))
        parts = per_rank(bounds, positions, chunks, self.layout)
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
        self._init_compat(False, None)
        self.p2p_groups = {}
