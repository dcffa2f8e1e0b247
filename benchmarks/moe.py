"""Expert parallelism on P ranks: tokens/s and all-to-all bytes per training step for
``ep_size`` 1, 2 and 4, against the closed form and against a dense model with the same active
parameters (issue 24's benchmark row).

The MoE model is a Hugging Face Mixtral (``E`` experts of width ``I``, top-``k`` routing)
trained with :class:`~kolossos.booster.plugin.MoeHybridParallelPlugin` at ``ep_size = P`` (fp32,
DDP for the dense weights); the dense baseline is a LLaMA of the same shape whose MLP has width
``k·I`` — the parameters one token touches are then the same — trained with
``HybridParallelPlugin(tp_size=1)`` over the same P ranks (data parallelism). Every rank trains
on its own ``batch x seq`` tokens (weak scaling); tokens/s counts all ranks' tokens.

All-to-all bytes per step (one forward + backward, per rank, counted by
:class:`~kolossos.utils.profiling.CommCounter`), per MoE layer:

* the closed form of the *logical* bytes (what the all-to-alls are handed, own rows included),
  as the mean over the ranks, is exact whatever the routing: dispatch and combine each move
  ``T·k`` rows of ``H`` floats on average, forward and backward, ``4·T·k·H·4`` bytes, plus one
  exchange of ``E`` int64 counts per forward (``8·E``) — a single rank hands over the rows it
  received for its combine, which depend on the routing, but their sum over the ranks does not;
* the bytes that leave the rank depend on the routing; under uniform routing a fraction
  ``(P-1)/P`` of the rows go to other ranks, which is the closed form printed next to the
  counter's model of the sent bytes.

Usage::

    python -m benchmarks moe --quick     # smoke run (~1 min on 2 cores)
    python -m benchmarks moe             # the figures of docs/moe.md
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

__all__ = ["Plan", "closed_form", "format_table", "main", "parse_args", "rank_main"]


@dataclass(frozen=True)
class Plan:
    """What one job measures."""

    hidden: int = 64
    intermediate: int = 64
    experts: int = 4
    top_k: int = 2
    layers: int = 2
    heads: int = 4
    vocab: int = 256
    batch: int = 4
    seq: int = 64
    steps: int = 5
    timeout: float = 1800.0


def closed_form(plan: Plan, ep: int) -> dict[str, float]:
    """All-to-all bytes per rank and step (module doc): exact logical bytes, and the sent bytes
    expected under uniform routing."""
    tokens = plan.batch * plan.seq
    rows = 4 * tokens * plan.top_k * plan.hidden * 4 * plan.layers
    counts = 8 * plan.experts * plan.layers
    if ep == 1:
        return {"logical": 0.0, "sent_uniform": 0.0}
    return {"logical": float(rows + counts), "sent_uniform": (rows + counts) * (ep - 1) / ep}


def _models(plan: Plan) -> tuple[Any, Any]:
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=plan.vocab, hidden_size=plan.hidden, num_hidden_layers=plan.layers,
        num_attention_heads=plan.heads, num_key_value_heads=plan.heads,
        max_position_embeddings=plan.seq, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    moe_config = transformers.MixtralConfig(
        **common,
        intermediate_size=plan.intermediate,
        num_local_experts=plan.experts,
        num_experts_per_tok=plan.top_k,
        router_jitter_noise=0.0,
    )
    moe = transformers.MixtralForCausalLM(moe_config)
    dense = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**common, intermediate_size=plan.top_k * plan.intermediate)
    )
    for model in (moe, dense):
        model.config._attn_implementation = "sdpa"
    return moe, dense


def _active_params(model: Any, plan: Plan) -> int:
    """Parameters one token uses: all but the unchosen experts."""
    total = 0
    for name, p in model.named_parameters():
        share = plan.top_k / plan.experts if ".experts." in name else 1.0
        total += int(p.numel() * share)
    return total


def _train(model: Any, plugin: Any, plan: Plan, count: bool) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from kolossos.booster import Booster
    from kolossos.utils.profiling import CommCounter

    active = _active_params(model, plan)
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert opt is not None
    gen = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.randint(1, plan.vocab, (plan.batch, plan.seq), generator=gen)

    def step() -> None:
        booster.backward(model(input_ids=ids, labels=ids).loss, opt)
        opt.step()
        opt.zero_grad()

    step()  # warm-up
    sent = logical = 0.0
    if count:
        with CommCounter() as comm:
            step()
        # the mean over the ranks: a rank's combine (and dispatch backward) hands over the rows
        # it *received*, which depend on the routing; their sum over the ranks does not
        both = torch.tensor([comm.bytes("all_to_all"), comm.sent_bytes("all_to_all")])
        dist.all_reduce(both)
        logical, sent = (float(v) / dist.get_world_size() for v in both)
    dist.barrier()
    began = time.perf_counter()
    for _ in range(plan.steps):
        step()
    dist.barrier()
    wall = time.perf_counter() - began
    tokens = plan.batch * plan.seq * dist.get_world_size() * plan.steps
    return {"tokens_per_s": tokens / wall, "a2a_logical": logical, "a2a_sent": sent,
            "active_params": active}  # fmt: skip


def rank_main(rank: int, world_size: int, port: int, plan: Plan) -> list[dict[str, Any]] | None:
    """Body of one rank (for :func:`kolossos.testing.spawn`); rank 0 returns the rows."""
    import warnings

    import torch

    import kolossos
    from kolossos.booster.plugin import HybridParallelPlugin, MoeHybridParallelPlugin

    warnings.simplefilter("ignore")
    kolossos.launch(config={}, rank=rank, world_size=world_size, host="127.0.0.1", port=port,
                    verbose=False, timeout=plan.timeout)  # fmt: skip
    torch.set_num_threads(1)
    torch.manual_seed(0)
    moe, dense = _models(plan)
    plugin = MoeHybridParallelPlugin(ep_size=world_size, precision="fp32")
    closed = {f"closed_{k}": v for k, v in closed_form(plan, world_size).items()}
    moe_row = {"model": "moe", "ranks": world_size, "ep": world_size}
    rows = [{**moe_row, **_train(moe, plugin, plan, count=True), **closed}]
    dense_plugin = HybridParallelPlugin(tp_size=1, precision="fp32")
    dense_row = {"model": "dense", "ranks": world_size, "ep": 1}
    rows.append({**dense_row, **_train(dense, dense_plugin, plan, count=False)})
    if rank == 0:
        print(f"[moe] P={world_size} done", file=sys.stderr, flush=True)
    return rows if rank == 0 else None


def format_table(rows: list[dict[str, Any]]) -> str:
    """The benchmark row as a Markdown table."""
    out = [
        "| model | ranks | ep | active params | tokens/s | vs dense | a2a logical B/step "
        "(closed form) | a2a sent B/step (uniform closed form) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    dense = {r["ranks"]: r["tokens_per_s"] for r in rows if r["model"] == "dense"}
    for r in rows:
        ratio = r["tokens_per_s"] / dense[r["ranks"]] if r["ranks"] in dense else float("nan")
        a2a = (
            f"{r['a2a_logical']:.0f} ({r['closed_logical']:.0f}) | "
            f"{r['a2a_sent']:.0f} ({r['closed_sent_uniform']:.0f})"
            if r["model"] == "moe"
            else "- | -"
        )
        out.append(
            f"| {r['model']} | {r['ranks']} | {r['ep']} | {r['active_params']} | "
            f"{r['tokens_per_s']:.0f} | {ratio:.2f} | {a2a} |"
        )
    return "\n".join(out)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see ``python -m benchmarks.moe --help``)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.moe",
                                description=__doc__.split("\n")[0])  # fmt: skip
    p.add_argument("--quick", action="store_true", help="smoke sizes")
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4], help="rank counts = ep")
    p.add_argument("--steps", type=int, help="timed steps per model")
    p.add_argument("--timeout", type=float, default=1800.0, help="wall-clock limit per job (s)")
    p.add_argument("--out", help="also write the rows as JSON to this file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run one job per rank count, print the table and one JSON line."""
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)  # before forking
    import transformers  # noqa: F401 - imported once, inherited by the forked ranks

    import kolossos.booster.plugin  # noqa: F401
    from kolossos.testing import spawn

    plan = Plan(timeout=args.timeout)
    if args.quick:
        plan = replace(plan, hidden=32, intermediate=32, seq=16, batch=2, steps=2)
    if args.steps:
        plan = replace(plan, steps=args.steps)
    for world in args.worlds:
        if world < 1 or plan.experts % world:
            raise SystemExit(f"--worlds {world}: ep = ranks must divide {plan.experts} experts")
    began = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for world in args.worlds:
        rows += spawn(rank_main, world, timeout=args.timeout, plan=plan)[0]
    print(format_table(rows))
    record = {"benchmark": "moe", "plan": asdict(plan), "rows": rows, "torch": torch.__version__,
              "wall_s": round(time.perf_counter() - began, 1)}  # fmt: skip
    print(json.dumps(record), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(record, fh)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
