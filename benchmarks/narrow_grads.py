"""bf16 gradients handed to the Adam update as they are, against fp32 copies: time and memory.

GPT-2 (``--layers`` x ``--hidden``, vocabulary 50257, 128 tokens, batch 4 per rank) in bf16 with
``HybridAdam`` on ``--ranks`` gloo ranks, trained by ZeRO-1, ZeRO-2 (``LowLevelZeroOptimizer``)
and Gemini (``GeminiDDP`` + ``GeminiOptimizer``), each twice: ``narrow`` as kolossos runs it
(``kolossos.zero.narrow_grads``: the bf16 gradients go to the update, which widens them a piece
at a time and multiplies in the deferred clipping factor) and ``fp32`` with the gradients in fp32
(ZeRO: ``narrow_grads = False``, the class switch ``HybridZeroOptimizer`` uses; Gemini: the
chunks' ``grad_dtype``). The two engines of a pair step alternately (step-interleaved, after two
warm-up steps). Per row: the median step time (forward, backward, ``clip_grad_by_norm(1.0)``,
step), the peak of the tensors the clipping and the step allocate (ZeRO's fp32 copies of its
partitions show here) and, for Gemini, its gradient shards after backward (ZeRO's partitions are
bf16 in both runs), MiB per rank, largest over the ranks.

Usage::

    python -m benchmarks.narrow_grads --layers 8 --hidden 512 --steps 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

ENGINES = ("zero1", "zero2", "gemini")
MiB = 2**20


def _build(engine: str, narrow: bool, config: Any) -> tuple[Any, Any, Any]:
    """``(model to call, optimizer, function giving the bytes of Gemini's gradient shards)``."""
    from transformers import GPT2LMHeadModel

    from kolossos.nn.optimizer import HybridAdam
    from kolossos.zero.gemini import GeminiDDP, GeminiOptimizer
    from kolossos.zero.low_level import LowLevelZeroOptimizer

    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).bfloat16()
    if engine == "gemini":
        gemini = GeminiDDP(model, mixed_precision=torch.bfloat16)
        opt = GeminiOptimizer(HybridAdam(gemini.parameters(), lr=1e-4), gemini)
        for chunk in gemini.chunk_manager if not narrow else ():
            chunk.grad_dtype = torch.float32

        def gemini_grads() -> int:
            shards = [c.grad_shard for c in gemini.chunk_manager if c.grad_shard is not None]
            return sum(g.numel() * g.element_size() for g in shards)

        return gemini, opt, gemini_grads

    class Fp32GradZero(LowLevelZeroOptimizer):
        narrow_grads = False

    cls = LowLevelZeroOptimizer if narrow else Fp32GradZero
    zero = cls(HybridAdam(model.parameters(), lr=1e-4), partition_grad=engine == "zero2")
    return model, zero, lambda: 0


def _rank(rank: int, world_size: int, port: int, layers: int, hidden: int, steps: int) -> Any:
    from transformers import GPT2Config

    import kolossos
    from kolossos.accelerator import TensorMemoryTracker

    kolossos.launch(config={}, rank=rank, world_size=world_size, host="127.0.0.1", port=port,
                    verbose=False)  # fmt: skip
    torch.set_num_threads(1)
    heads = max(1, hidden // 64)
    config = GPT2Config(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=50257,
                        n_positions=128, bos_token_id=0, eos_token_id=0)  # fmt: skip
    ids = torch.randint(0, 50257, (4, 128), generator=torch.Generator().manual_seed(rank))
    result: dict[str, dict[str, float]] = {}
    for engine in ENGINES:
        pair = {name: _build(engine, name == "narrow", config) for name in ("fp32", "narrow")}
        times: dict[str, list[float]] = {name: [] for name in pair}
        peaks: dict[str, list[int]] = {name: [] for name in pair}
        grads: dict[str, int] = {}
        for step in range(steps + 2):
            for name, (model, opt, grad_bytes) in pair.items():
                dist.barrier()
                start = time.perf_counter()
                opt.backward(model(input_ids=ids, labels=ids).loss)
                grads[name] = grad_bytes()
                with TensorMemoryTracker("cpu") as tracker:
                    opt.clip_grad_by_norm(1.0)
                    opt.step()
                opt.zero_grad()
                dist.barrier()
                if step >= 2:
                    times[name].append(time.perf_counter() - start)
                    peaks[name].append(tracker.peak_bytes)
        for name in pair:
            result[f"{engine}/{name}"] = {
                "step_ms": 1e3 * statistics.median(times[name]),
                "step_alloc_mib": max(peaks[name]) / MiB,
                "grads_mib": grads[name] / MiB,
            }
        del pair
    return result


def main(argv: list[str] | None = None) -> int:
    """Command line (module doc)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.narrow_grads", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--ranks", type=int, default=2)
    args = p.parse_args(argv)
    if min(args.layers, args.hidden, args.steps, args.ranks) < 1:
        p.error("--layers, --hidden, --steps and --ranks must be positive")
    from kolossos.testing import spawn

    ranks = spawn(_rank, args.ranks, timeout=1800, layers=args.layers, hidden=args.hidden,
                  steps=args.steps)  # fmt: skip
    rows = {
        key: {
            "step_ms": max(r[key]["step_ms"] for r in ranks),
            "step_alloc_mib": max(r[key]["step_alloc_mib"] for r in ranks),
            "grads_mib": max(r[key]["grads_mib"] for r in ranks),
        }
        for key in ranks[0]
    }
    print(f"GPT-2 {args.layers} x {args.hidden}, bf16, HybridAdam, {args.ranks} ranks, "
          f"median of {args.steps} steps")  # fmt: skip
    print("| engine / gradients | step ms | allocated by clip + step, MiB | gradient shards, MiB |")
    print("|---|---|---|---|")
    for key, row in rows.items():
        shards = f"{row['grads_mib']:.1f}" if key.startswith("gemini") else "—"
        print(f"| {key} | {row['step_ms']:.0f} | {row['step_alloc_mib']:.1f} | {shards} |")
    print(json.dumps({"args": vars(args), "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
