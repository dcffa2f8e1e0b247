"""What moving one buffer between two CPU ranks on one host costs, by path.

Two gloo ranks; rank 1 hands ``--mib`` MiB of fp32 to rank 0, which adds it into its own buffer
(what a ZeRO reduce-to-owner does with a bucket). Each path is timed over ``--loops`` transfers,
twice, alternating with the others; the best of the two is reported as wall milliseconds and CPU
milliseconds (the process's, all threads, kernel included) summed over both ranks:

* ``socket``: ``isend`` / ``irecv`` into a buffer reused every time (gloo over loopback TCP:
  the bytes are copied into a socket by the sender and out of it by the receiver);
* ``socket-fresh``: the same into a buffer allocated for each transfer (its pages are faulted and
  zeroed by the kernel as the data arrives);
* ``shared-memory``: the sender copies into a segment of ``/dev/shm`` both ranks mapped, then
  signals with a one-element ``isend``; the receiver adds from the segment.

Usage::

    python -m benchmarks.loopback_cost --mib 100 --loops 5
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.timing import time_collective

__all__ = ["PATHS", "main"]

PATHS = ("socket", "socket-fresh", "shared-memory")


def _wait(work: Any) -> None:
    """Wait for a point-to-point transfer (``None`` when the group is not this rank's)."""
    if work is not None:
        work.wait()


def _paths(rank: int, numel: int, segment: str) -> dict[str, Callable[[], None]]:
    source, total, reused = torch.randn(numel), torch.zeros(numel), torch.zeros(numel)
    shared = torch.from_file(segment, shared=True, size=numel, dtype=torch.float32)
    flag = torch.zeros(1)

    def socket(fresh: bool) -> None:
        if rank == 1:
            _wait(dist.isend(source, 0))
            return
        received = torch.empty(numel) if fresh else reused
        _wait(dist.irecv(received, 1))
        total.add_(received)

    def shared_memory() -> None:
        if rank == 1:
            shared.copy_(source)
            _wait(dist.isend(flag, 0))
            return
        _wait(dist.irecv(flag, 1))
        total.add_(shared)

    return {
        "socket": lambda: socket(False),
        "socket-fresh": lambda: socket(True),
        "shared-memory": shared_memory,
    }


def _rank(rank: int, world_size: int, port: int, mib: float, loops: int, segment: str) -> Any:
    import kolossos

    kolossos.launch(config={}, rank=rank, world_size=world_size, host="127.0.0.1", port=port,
                    verbose=False)  # fmt: skip
    torch.set_num_threads(1)
    paths = _paths(rank, int(mib * 2**20) // 4, segment)
    best: dict[str, tuple[float, float]] = {}
    for _ in range(2):
        for name, transfer in paths.items():
            dist.barrier()
            transfer()  # warm-up
            took = time_collective(transfer, loops)
            best[name] = min(best.get(name, took), took)
    return best


def main(argv: list[str] | None = None) -> int:
    """Command line (module doc)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.loopback_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--mib", type=float, default=100.0, help="MiB per transfer")
    p.add_argument("--loops", type=int, default=5)
    args = p.parse_args(argv)
    if args.mib <= 0 or args.loops < 1:
        p.error(f"--mib {args.mib} and --loops {args.loops}: both must be positive")
    from kolossos.testing import spawn

    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(dir=shm) as tmp:
        segment = os.path.join(tmp, "segment")
        ranks = spawn(_rank, 2, timeout=600, mib=args.mib, loops=args.loops, segment=segment)
    result = {
        name: {
            "wall_ms": 1e3 * max(r[name][0] for r in ranks),
            "cpu_ms": 1e3 * sum(r[name][1] for r in ranks),
        }
        for name in PATHS
    }
    print(f"{args.mib:g} MiB from rank 1 to rank 0, best of 2 x {args.loops} transfers:")
    for name, cost in result.items():
        wall, cpu = cost["wall_ms"], cost["cpu_ms"]
        print(f"  {name:14s} wall {wall:7.1f} ms   CPU (both ranks) {cpu:7.1f} ms")
    print(json.dumps({"mib": args.mib, "loops": args.loops, "paths": result}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
