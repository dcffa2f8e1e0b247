"""The layout converter's cost model against measured time on gloo (4 CPU ranks, 2 x 2 mesh).

The mesh's alpha-beta model is fitted first (``kolossos.device.alpha_beta_profiler``: timed
all-gathers along each axis); then, for the docs' worked conversions and a few more, the model's
forward cost of the planned path is compared with the measured median time of
``LayoutConverter.apply`` on a ``(SIZE, SIZE, 16)`` float32 tensor. Prints a table and one JSON
line (``ratio`` = model / measured). A measurement, not a test: times on shared machines are
noisy, the ratio is the figure.

Run::

    OMP_NUM_THREADS=1 python -m benchmarks.layout_conversion_cost [--size 256] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import kolossos
from kolossos.device.alpha_beta_profiler import profile_alpha_beta
from kolossos.device.device_mesh import DeviceMesh
from kolossos.tensor.d_tensor import Layout, LayoutConverter, ShardingSpec
from kolossos.testing import spawn

CONVERSIONS = [
    ("S01RR", "RS01R"),  # the docs' worked example (3 steps)
    ("S0RR", "RS01R"),
    ("RS0R", "RS01R"),
    ("S0RR", "RRR"),
    ("S01RR", "RRR"),
    ("S0S1R", "S1S0R"),
]


def _measure(converter: LayoutConverter, src: Layout, dst: Layout, repeats: int) -> float:
    full = torch.randn(*src.global_shape, generator=torch.Generator().manual_seed(0))
    mesh = src.device_mesh.get_torch_mesh()
    from torch.distributed.tensor import distribute_tensor

    dt = distribute_tensor(full, mesh, src.placements())
    converter.apply(DTensor.from_local(dt.to_local(), mesh, dt.placements), src, dst)  # warm-up
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        out = converter.apply(dt, src, dst)
        out.to_local().sum()  # the local result is materialised
        times.append(time.perf_counter() - start)
    # SYNC POINT: the slowest rank's median is the conversion's time
    median = torch.tensor([statistics.median(times)])
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return float(median.item())


def _run(rank: int, world_size: int, port: int, size: int, repeats: int) -> None:
    kolossos.launch(
        config={},
        rank=rank,
        world_size=world_size,
        host="127.0.0.1",
        port=port,
        backend="gloo",
        verbose=False,
    )
    probe = DeviceMesh(torch.arange(4), (2, 2), device="cpu")
    alpha, beta = profile_alpha_beta(
        probe, sizes_bytes=(1 << 14, 1 << 20, 1 << 23), repeats=repeats
    )
    mesh = DeviceMesh(torch.arange(4), (2, 2), mesh_alpha=alpha, mesh_beta=beta, device="cpu")
    mesh._torch_mesh = probe.get_torch_mesh()  # reuse the groups: same logical mesh
    converter = LayoutConverter()
    rows: list[dict[str, Any]] = []
    shape = (size, size, 16)
    for src_text, dst_text in CONVERSIONS:
        src = Layout(mesh, ShardingSpec.from_notation(src_text), shape)
        dst = Layout(mesh, ShardingSpec.from_notation(dst_text), shape)
        path, _ = converter.layout_converting(src, dst)
        model = converter.get_total_comm_cost(src, dst)["forward"]
        measured = _measure(converter, src, dst, repeats)
        rows.append(
            {
                "conversion": f"{src_text} -> {dst_text}",
                "path": " -> ".join(str(p.sharding_spec) for p in path),
                "model_ms": model * 1e3,
                "measured_ms": measured * 1e3,
                "ratio": model / measured if measured else float("nan"),
            }
        )
    if rank == 0:
        print(f"alpha (s) per axis {alpha}, beta (s/byte) per axis {beta}")
        print(f"{'conversion':<18} {'path':<32} {'model ms':>9} {'measured ms':>12} {'ratio':>6}")
        for r in rows:
            print(
                f"{r['conversion']:<18} {r['path']:<32} {r['model_ms']:>9.2f} "
                f"{r['measured_ms']:>12.2f} {r['ratio']:>6.2f}"
            )
        print(
            json.dumps(
                {
                    "benchmark": "layout_conversion_cost",
                    "shape": shape,
                    "alpha": alpha,
                    "beta": beta,
                    "rows": rows,
                }
            )
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=256, help="the tensor is (size, size, 16)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    spawn(_run, 4, size=args.size, repeats=args.repeats)


if __name__ == "__main__":
    main()
