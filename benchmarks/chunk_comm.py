"""What gathering and reduce-scattering one Gemini chunk costs on gloo ranks of one host, by scheme.

``--ranks`` gloo ranks each hold a ``--mib`` MiB fp32 chunk split in equal slices. Per scheme,
a **gather** fills a freshly allocated chunk with every rank's slice (as Gemini gathers a payload
before a module uses it) and a **reduce-scatter** leaves each rank the sum of its slice over every
rank's chunk (a chunk's gradients). Each is timed over ``--loops`` calls, twice, alternating with
the other schemes; the best of the two is reported as wall milliseconds and CPU milliseconds (the
process's, all threads, kernel included) summed over the ranks. Results are checked against
each other before timing.

* ``flat``: gloo's own ``all_gather_into_tensor`` / ``reduce_scatter_tensor``;
* ``per-slice``: one ``broadcast`` per rank's slice from that rank / one ``reduce`` per slice to
  its rank;
* ``point-to-point``: every rank sends its slice (gather) or each peer's slice (reduce) to each
  peer with ``isend``, receives into the chunk (gather) or scratch buffers it then adds (reduce);
* ``kolossos``: :class:`~kolossos.zero.gemini.chunk.comm.ChunkComm` (two ranks: one
  point-to-point exchange; more: ``per-slice``).

Usage::

    python -m benchmarks.chunk_comm --ranks 4 --mib 64 --loops 4
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.timing import time_collective

__all__ = ["SCHEMES", "main"]

SCHEMES = ("flat", "per-slice", "point-to-point", "kolossos")
# torch 2.13 renamed the flat collectives (the old names warn); 2.11 only has the old names
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
Ops = tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]


def _schemes(rank: int, n: int, numel: int) -> dict[str, Ops]:
    from kolossos.zero.gemini.chunk.comm import ChunkComm

    size = numel // n
    comm = ChunkComm(None)
    shard = torch.randn(size, generator=torch.Generator().manual_seed(rank))
    grads = torch.randn(numel, generator=torch.Generator().manual_seed(100 + rank))
    full = torch.empty(numel)  # the chunk's gradients, clobbered by some schemes: refilled

    def flat() -> Ops:
        def gather() -> torch.Tensor:
            payload = torch.empty(numel)
            _ALL_GATHER(payload, shard)
            return payload

        def reduce() -> torch.Tensor:
            out = torch.empty(size)
            _REDUCE_SCATTER(out, full.copy_(grads))
            return out

        return gather, reduce

    def per_slice() -> Ops:
        def gather() -> torch.Tensor:
            payload = torch.empty(numel)
            payload[rank * size : (rank + 1) * size].copy_(shard)
            works = [dist.broadcast(payload[r * size : (r + 1) * size], r, async_op=True)
                     for r in range(n)]  # fmt: skip
            for work in works:
                work.wait()
            return payload

        def reduce() -> torch.Tensor:
            full.copy_(grads)
            works = [dist.reduce(full[r * size : (r + 1) * size], r, async_op=True)
                     for r in range(n)]  # fmt: skip
            for work in works:
                work.wait()
            return full[rank * size : (rank + 1) * size].clone()

        return gather, reduce

    peers = [r for r in range(n) if r != rank]

    def exchange(sends: list[torch.Tensor], receives: list[torch.Tensor]) -> None:
        ops = [dist.P2POp(op, t, peer, tag=5) for peer, send, receive in
               zip(peers, sends, receives, strict=True)
               for op, t in ((dist.isend, send), (dist.irecv, receive))]  # fmt: skip
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    def point_to_point() -> Ops:
        def gather() -> torch.Tensor:
            payload = torch.empty(numel)
            mine = payload[rank * size : (rank + 1) * size].copy_(shard)
            exchange([mine] * len(peers), [payload[p * size : (p + 1) * size] for p in peers])
            return payload

        def reduce() -> torch.Tensor:
            full.copy_(grads)
            out, scratch = torch.empty(size), torch.empty(len(peers) - 1, size)
            exchange([full[p * size : (p + 1) * size] for p in peers], [out, *scratch.unbind()])
            out.add_(full[rank * size : (rank + 1) * size])
            for part in scratch.unbind():
                out.add_(part)
            return out

        return gather, reduce

    def kolossos() -> Ops:
        def gather() -> torch.Tensor:
            payload = torch.empty(numel)
            comm.all_gather(payload, shard, tag=1)
            return payload

        def reduce() -> torch.Tensor:
            out = torch.empty(size)
            comm.reduce_scatter(out, full.copy_(grads), tag=1)
            return out

        return gather, reduce

    return {"flat": flat(), "per-slice": per_slice(), "point-to-point": point_to_point(),
            "kolossos": kolossos()}  # fmt: skip


def _rank(rank: int, world_size: int, port: int, mib: float, loops: int) -> Any:
    import kolossos

    kolossos.launch(config={}, rank=rank, world_size=world_size, host="127.0.0.1", port=port,
                    verbose=False)  # fmt: skip
    torch.set_num_threads(1)
    numel = int(mib * 2**20) // 4 // world_size * world_size
    schemes = _schemes(rank, world_size, numel)
    reference = [op() for op in schemes["flat"]]
    for name, ops in schemes.items():
        for op, want in zip(ops, reference, strict=True):
            torch.testing.assert_close(op(), want, msg=f"{name} differs from flat")
    best: dict[str, tuple[float, float]] = {}
    for _ in range(2):
        for name, ops in schemes.items():
            for kind, op in zip(("gather", "reduce-scatter"), ops, strict=True):
                took = time_collective(op, loops)
                key = f"{name}/{kind}"
                best[key] = min(best.get(key, took), took)
    return best


def main(argv: list[str] | None = None) -> int:
    """Command line (module doc)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.chunk_comm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--mib", type=float, default=64.0, help="MiB per chunk")
    p.add_argument("--loops", type=int, default=4)
    args = p.parse_args(argv)
    if args.ranks < 2 or args.mib <= 0 or args.loops < 1:
        p.error(f"--ranks {args.ranks}, --mib {args.mib}, --loops {args.loops}: need at least "
                "2 ranks, a positive size and at least one loop")  # fmt: skip
    from kolossos.testing import spawn

    ranks = spawn(_rank, args.ranks, timeout=600, mib=args.mib, loops=args.loops)
    result = {
        key: {
            "wall_ms": 1e3 * max(r[key][0] for r in ranks),
            "cpu_ms": 1e3 * sum(r[key][1] for r in ranks),
        }
        for key in ranks[0]
    }
    print(f"a {args.mib:g} MiB chunk on {args.ranks} ranks, best of 2 x {args.loops} calls:")
    for key, cost in result.items():
        wall, cpu = cost["wall_ms"], cost["cpu_ms"]
        print(f"  {key:30s} wall {wall:7.1f} ms   CPU (all ranks) {cpu:7.1f} ms")
    print(json.dumps({"ranks": args.ranks, "mib": args.mib, "loops": args.loops,
                      "schemes": result}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
