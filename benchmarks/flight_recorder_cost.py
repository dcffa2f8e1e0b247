"""What torch's flight recorder (on by default under ``kolossos.launch``) costs per collective.

The driver starts 2-rank gloo jobs alternately with ``TORCH_FR_BUFFER_SIZE=0`` (off) and with the
default kolossos sets (2000 entries); each job times small all-reduces (the worst case: the
recording is a fixed cost per collective) and reports the best of 5 loops of ``--ops``. The
medians over ``--reps`` jobs per setting are printed with their difference, then a JSON line.

Usage::

    python -m benchmarks.flight_recorder_cost --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from kolossos.cluster.flight_recorder import DEFAULT_ENTRIES


def _child(ops: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1)
    for _ in range(200):  # warm-up
        dist.all_reduce(t)
    best = float("inf")
    for _ in range(5):
        dist.barrier()
        began = time.perf_counter()
        for _ in range(ops):
            dist.all_reduce(t)
        best = min(best, time.perf_counter() - began)
    if dist.get_rank() == 0:
        print(json.dumps({"us_per_op": best / ops * 1e6}), flush=True)
    dist.destroy_process_group()


def _job(entries: int, ops: int) -> float:
    env = dict(os.environ, TORCH_FR_BUFFER_SIZE=str(entries), OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    argv += ["-m", "benchmarks.flight_recorder_cost", "--child", "--ops", str(ops)]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("{"))
    return float(json.loads(line)["us_per_op"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="jobs per setting")
    parser.add_argument("--ops", type=int, default=2000, help="all-reduces per timed loop")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.ops)
        return
    times: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(args.reps):  # alternate, so load drifts hit both settings alike
        times["off"].append(_job(0, args.ops))
        times["on"].append(_job(DEFAULT_ENTRIES, args.ops))
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    print(f"1-element gloo all_reduce, 2 ranks, median of {args.reps} jobs (best of 5 loops each)")
    print(f"  flight recorder off : {off:7.1f} us")
    print(f"  flight recorder on  : {on:7.1f} us  (+{on - off:.1f} us per collective)")
    print(json.dumps({"benchmark": "flight_recorder_cost", "off_us": off, "on_us": on}))


if __name__ == "__main__":
    main()
