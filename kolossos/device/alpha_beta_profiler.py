"""Measure the alpha-beta communication model of a :class:`DeviceMesh` (Colossal-AI's device
mesh "profiles the cluster to estimate the cost of communication operators").

Along each mesh axis, all-gathers of a few message sizes are timed (as DTensor runs them, the
executor of the layout converter) and a least-squares line
``time = alpha + beta * bytes_moved`` is fitted, where ``bytes_moved = (n - 1) / n * output``
as in :meth:`DeviceMesh.all_gather_cost`. The result can be passed back as ``mesh_alpha`` /
``mesh_beta`` so that the layout converter's cost model predicts seconds.

Example:
    >>> alpha, beta = profile_alpha_beta(mesh)  # doctest: +SKIP
    >>> ids = torch.arange(4)
    >>> mesh = DeviceMesh(ids, (2, 2), mesh_alpha=alpha, mesh_beta=beta)  # doctest: +SKIP
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from kolossos.device.device_mesh import DeviceMesh

__all__ = ["profile_alpha_beta"]


def _time_all_gather(mesh: TorchDeviceMesh, axis: int, numel: int, repeats: int) -> float:
    """Median time of a DTensor all-gather (``Shard(0) -> Replicate`` along ``axis``) of a
    float32 tensor whose piece has ``numel`` elements: the collective the layout converter runs."""
    before: list[Placement] = [Replicate()] * mesh.ndim
    before[axis] = Shard(0)
    piece = DTensor.from_local(torch.ones(numel), mesh, before, run_check=False)
    after = [Replicate()] * mesh.ndim
    piece.redistribute(mesh, after).to_local()  # warm-up
    group = mesh.get_group(axis)
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        start = time.perf_counter()
        piece.redistribute(mesh, after).to_local().sum()
        times.append(time.perf_counter() - start)
    # SYNC POINT: every rank of the group agrees on the slowest median
    median = torch.tensor([statistics.median(times)])
    dist.all_reduce(median, op=dist.ReduceOp.MAX, group=group)
    return float(median.item())


def profile_alpha_beta(
    mesh: DeviceMesh,
    sizes_bytes: Sequence[int] = (1 << 12, 1 << 18, 1 << 21),
    repeats: int = 5,
) -> tuple[list[float], list[float]]:
    """Fit ``(mesh_alpha, mesh_beta)`` (seconds, seconds per byte) per axis of ``mesh``.

    COLLECTIVE: every rank of the mesh calls it (it uses the mesh's torch groups).

    Args:
        mesh: the mesh to profile (``torch.distributed`` must be initialised).
        sizes_bytes: all-gather output sizes per rank to time (at least two).
        repeats: timed repetitions per size (the median counts).

    Raises:
        ValueError: fewer than two sizes, or ``repeats < 1``.
    """
    if len(sizes_bytes) < 2 or repeats < 1:
        raise ValueError(
            f"profile_alpha_beta(sizes_bytes={list(sizes_bytes)}, repeats={repeats}): give at "
            "least two sizes and repeats >= 1."
        )
    torch_mesh = mesh.get_torch_mesh()
    alphas, betas = [], []
    for axis, n in enumerate(tuple(mesh.shape)):
        xs, ys = [], []
        for size in sizes_bytes:
            numel = max(1, size // 4 // n)
            xs.append((n - 1) / n * numel * n * 4)
            ys.append(_time_all_gather(torch_mesh, axis, numel, repeats))
        mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
        var = sum((x - mean_x) ** 2 for x in xs)
        beta = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var
        beta = max(beta, 0.0)
        alphas.append(max(mean_y - beta * mean_x, 0.0))
        betas.append(beta)
    return alphas, betas
