"""``LayoutConverter``: turn one sharding layout of a tensor into another by a greedy search over
single-step transforms, cost the path with the mesh's bandwidth model, and run it with DTensor.

The search (Colossal-AI's "heuristic greedy search"):

1. from the current layout, generate every layout one step away — an **all-gather** makes the
   last mesh axis of a cut dimension whole again (``S01 -> S0``), an **all-to-all** moves the last
   mesh axis of a cut dimension onto another dimension (``S0R -> RS0``), a **shard** cuts a
   dimension by a mesh axis no dimension uses yet (``R -> S1``, ``S0 -> S01``); a dimension's axes
   stay in increasing order (``S10`` is never produced);
2. if one of them is the target, stop; else move to the one with the least
   :meth:`~kolossos.tensor.sharding_spec.ShardingSpec.spec_diff` to the target (the first such
   in the order all-gathers, all-to-alls, shards; dimensions and axes in increasing order) and
   record it in the path;
3. repeat.

Each step runs as one ``DTensor.redistribute`` between the placements of consecutive layouts, so
the path is differentiable (backward runs the reverse steps). On a CPU mesh DTensor performs an
all-to-all as all-gather + chunk (gloo has no all-to-all in DTensor); the cost model follows it.

Example (no process group needed to plan):
    >>> from kolossos.device.device_mesh import DeviceMesh
    >>> mesh = DeviceMesh(torch.arange(4), (2, 2), device="cpu")
    >>> src = Layout(mesh, ShardingSpec.from_notation("S01RR"), (4, 4, 4))
    >>> dst = Layout(mesh, ShardingSpec.from_notation("RS01R"), (4, 4, 4))
    >>> path, _ = LayoutConverter().layout_converting(src, dst)
    >>> " -> ".join(str(l.sharding_spec) for l in path)
    'S01RR -> S0RR -> RS0R -> RS01R'
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor

from kolossos.tensor.comm_spec import CollectiveCommPattern, CommSpec
from kolossos.tensor.d_tensor.layout import Layout
from kolossos.tensor.sharding_spec import ShardingSpec

__all__ = ["MAX_TRANSFORM_STEPS", "LayoutConverter"]

#: the search gives up after this many steps
MAX_TRANSFORM_STEPS = 20

Candidates = dict[Layout, CommSpec]


def _try_add(out: Candidates, layout: Layout, spec: dict[int, list[int]], comm: CommSpec) -> None:
    try:
        new = Layout(
            layout.device_mesh, ShardingSpec(layout.sharding_spec.dims, spec), layout.global_shape
        )
    except ValueError:  # the pieces would not divide the dimension: not a valid layout
        return
    out[new] = comm


class LayoutConverter:
    """Plans (:meth:`layout_converting`), costs (:meth:`get_total_comm_cost`) and runs
    (:meth:`apply`) layout conversions; plans are cached per (source, target) pair.

    Args:
        all_to_all_as_all_gather: cost an all-to-all as the all-gather + chunk DTensor runs
            instead; ``None``: on a CPU mesh (gloo) only.
    """

    def __init__(self, all_to_all_as_all_gather: bool | None = None) -> None:
        self.all_to_all_as_all_gather = all_to_all_as_all_gather
        self.cached_solution: dict[tuple[object, ...], tuple[list[Layout], list[CommSpec]]] = {}

    # ---- one-step transforms -------------------------------------------------------------------

    def all_gather_transform_layouts(self, layout: Layout) -> Candidates:
        """Every layout one all-gather away: a cut dimension loses its last mesh axis."""
        out: Candidates = {}
        parts = layout.sharding_spec.dim_partition_dict
        for dim, axes in parts.items():
            spec = {**parts, dim: axes[:-1]}
            comm = CommSpec(
                CollectiveCommPattern.GATHER_FWD_SPLIT_BWD,
                gather_dim=dim,
                shard_dim=dim,
                logical_process_axis=axes[-1],
            )
            _try_add(out, layout, spec, comm)
        return out

    def all_to_all_transform_layout(self, layout: Layout) -> Candidates:
        """Every layout one all-to-all away: the last mesh axis of a cut dimension moves to the
        end of another dimension's axes (which must stay increasing)."""
        out: Candidates = {}
        parts = layout.sharding_spec.dim_partition_dict
        for src, axes in parts.items():
            axis = axes[-1]
            for dst in range(layout.sharding_spec.dims):
                dst_axes = parts.get(dst, [])
                if dst == src or (dst_axes and dst_axes[-1] > axis):
                    continue
                spec = {**parts, src: axes[:-1], dst: [*dst_axes, axis]}
                comm = CommSpec(
                    CollectiveCommPattern.ALL2ALL_FWD_ALL2ALL_BWD,
                    gather_dim=src,
                    shard_dim=dst,
                    logical_process_axis=axis,
                )
                _try_add(out, layout, spec, comm)
        return out

    def shard_transform_layout(self, layout: Layout) -> Candidates:
        """Every layout one local shard away: a dimension gains an unused mesh axis at the end
        of its axes (which must stay increasing)."""
        out: Candidates = {}
        parts = layout.sharding_spec.dim_partition_dict
        free = sorted(
            set(range(len(tuple(layout.device_mesh.shape)))) - layout.sharding_spec.used_axes()
        )
        for dim in range(layout.sharding_spec.dims):
            axes = parts.get(dim, [])
            for axis in free:
                if axes and axis < axes[-1]:
                    continue
                comm = CommSpec(
                    CollectiveCommPattern.SPLIT_FWD_GATHER_BWD,
                    gather_dim=dim,
                    shard_dim=dim,
                    logical_process_axis=axis,
                )
                _try_add(out, layout, {**parts, dim: [*axes, axis]}, comm)
        return out

    def get_all_one_step_transform_spec(self, layout: Layout) -> Candidates:
        """All one-step layouts, in the search's order: all-gathers, all-to-alls, shards."""
        return {
            **self.all_gather_transform_layouts(layout),
            **self.all_to_all_transform_layout(layout),
            **self.shard_transform_layout(layout),
        }

    # ---- search ----------------------------------------------------------------------------

    def layout_converting(
        self, source: Layout, target: Layout
    ) -> tuple[list[Layout], list[CommSpec]]:
        """The greedy path from ``source`` to ``target``.

        Returns:
            ``(path, steps)``: the layouts from ``source`` to ``target`` (both included; empty
            when they are equal) and the ``CommSpec`` of each step.

        Raises:
            ValueError: the layouts differ in mesh shape or global shape.
            RuntimeError: no path within :data:`MAX_TRANSFORM_STEPS` steps.
        """
        if tuple(source.device_mesh.shape) != tuple(target.device_mesh.shape):
            raise ValueError(
                f"cannot convert between meshes {source.device_mesh} and {target.device_mesh}."
            )
        if source.global_shape != target.global_shape:
            raise ValueError(
                f"source shape {tuple(source.global_shape)} and target shape "
                f"{tuple(target.global_shape)} differ; a layout conversion keeps the shape."
            )
        key = (
            source.sharding_spec,
            target.sharding_spec,
            tuple(source.device_mesh.shape),
            tuple(source.global_shape),
        )
        if key in self.cached_solution:
            cached, cached_steps = self.cached_solution[key]
            mesh = source.device_mesh
            return [Layout(mesh, p.sharding_spec, p.global_shape) for p in cached], list(
                cached_steps
            )
        path: list[Layout] = []
        steps: list[CommSpec] = []
        if source.sharding_spec != target.sharding_spec:
            path.append(source)
            current = source
            while current.sharding_spec != target.sharding_spec:
                if len(steps) >= MAX_TRANSFORM_STEPS:
                    raise RuntimeError(
                        f"no conversion from {source.sharding_spec} to {target.sharding_spec} "
                        f"within {MAX_TRANSFORM_STEPS} steps."
                    )
                current, comm = self._best_step(current, target.sharding_spec)
                path.append(current)
                steps.append(comm)
        self.cached_solution[key] = (path, steps)
        return list(path), list(steps)

    def _best_step(self, current: Layout, target: ShardingSpec) -> tuple[Layout, CommSpec]:
        best: tuple[Layout, CommSpec] | None = None
        best_score = math.inf
        for layout, comm in self.get_all_one_step_transform_spec(current).items():
            score = layout.sharding_spec.spec_diff(target)
            if score == 0:
                return layout, comm
            if score < best_score:
                best, best_score = (layout, comm), score
        if best is None:
            raise RuntimeError(f"layout {current} has no one-step transform.")
        return best

    # ---- cost ------------------------------------------------------------------------------

    def step_cost(self, before: Layout, comm: CommSpec) -> dict[str, float]:
        """Modelled forward/backward time of ``comm`` applied to ``before``: per collective
        ``alpha + beta * bytes moved`` with the mesh's ``mesh_alpha`` / ``mesh_beta`` of the
        step's axis (an all-gather of ``B`` output bytes over ``n`` ranks moves
        ``(n - 1) / n * B``; an all-to-all of ``B`` local bytes moves ``(n - 1) / n * B``); a
        shard is a local copy, free."""
        mesh, axis = before.device_mesh, comm.logical_process_axis
        n = tuple(mesh.shape)[axis]
        item = torch.empty((), dtype=torch.float32).element_size()
        local_bytes = float(math.prod(before.local_shape)) * item

        def moved(num_bytes: float) -> float:
            return mesh.mesh_alpha[axis] + mesh.mesh_beta[axis] * (n - 1) / n * num_bytes

        if comm.comm_pattern is CollectiveCommPattern.GATHER_FWD_SPLIT_BWD:
            forward, backward = moved(local_bytes * n), 0.0
        elif comm.comm_pattern is CollectiveCommPattern.SPLIT_FWD_GATHER_BWD:
            forward, backward = 0.0, moved(local_bytes)
        else:
            as_gather = self.all_to_all_as_all_gather
            if as_gather is None:
                as_gather = mesh.device_type == "cpu"
            forward = backward = moved(local_bytes * n) if as_gather else moved(local_bytes)
        return {"forward": forward, "backward": backward, "total": forward + backward}

    def get_total_comm_cost(self, source: Layout, target: Layout) -> dict[str, float]:
        """Modelled time of the whole conversion (``forward``, ``backward``, ``total``)."""
        path, steps = self.layout_converting(source, target)
        total = {"forward": 0.0, "backward": 0.0, "total": 0.0}
        for before, comm in zip(path, steps, strict=False):
            for key, value in self.step_cost(before, comm).items():
                total[key] += value
        return total

    # ---- run -------------------------------------------------------------------------------

    def apply(self, tensor: DTensor, source: Layout, target: Layout) -> DTensor:
        """Convert ``tensor`` (a DTensor in ``source``'s placements) to ``target``, step by
        step along the planned path; differentiable.

        Raises:
            TypeError: ``tensor`` is not a DTensor.
            ValueError: its placements or shape are not ``source``'s.
        """
        if not isinstance(tensor, DTensor):
            raise TypeError(f"LayoutConverter.apply needs a DTensor, got {type(tensor).__name__}.")
        if (
            tuple(tensor.placements) != tuple(source.placements())
            or tensor.shape != source.global_shape
        ):
            raise ValueError(
                f"tensor {tuple(tensor.shape)} {tensor.placements} does not have the source layout "
                f"{source}."
            )
        path, _ = self.layout_converting(source, target)
        out = tensor
        for layout in path[1:]:
            out = out.redistribute(tensor.device_mesh, layout.placements())
        return out
