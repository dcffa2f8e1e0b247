"""``kolossos plan``: which plugin and layout fit a model in a memory budget, and what to type.

For every plugin and layout kolossos offers (DDP, ZeRO-1/2 with and without CPU offload, Gemini
placements, FSDP2, tensor x pipeline x data parallel hybrids, each with and without activation
checkpointing) the per-rank peak memory and bytes communicated per step are estimated from the
model's config (:mod:`kolossos.utils.profiling.planner`); the layouts that fit are listed, one is
recommended, and its plugin call is printed as Python. ``--json`` prints one JSON object.
``docs/plan.md`` says what is modelled and how accurate it is.

Example::

    kolossos plan --model gpt2-medium --nproc 8 --mem-per-rank 24GB --seq-len 1024 --batch 64
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import NoReturn

from kolossos.cli.usage import explain_unknown

__all__ = ["main", "parse_size"]

PROG = "kolossos plan"
_UNITS = {
    "": 1, "b": 1,
    "k": 2**10, "kib": 2**10, "kb": 10**3,
    "m": 2**20, "mib": 2**20, "mb": 10**6,
    "g": 2**30, "gib": 2**30, "gb": 10**9,
    "t": 2**40, "tib": 2**40, "tb": 10**12,
}  # fmt: skip
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        if "expected one argument" in message:
            message += " (to pass a value that starts with '-', write --option=VALUE)"
        raise _UsageError(explain_unknown(message, self))


def parse_size(text: str) -> int:
    """Bytes of a size such as ``24GB`` (10⁹), ``24GiB`` / ``24G`` (2³⁰), ``512MiB``, ``1.5T``.

    Raises:
        ValueError: not a positive number with a known unit.

    Example:
        >>> parse_size("8G"), parse_size("512MiB"), parse_size("1GB")
        (8589934592, 536870912, 1000000000)
    """
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ValueError(
            f"--mem-per-rank {text!r} is not a size: write a number and a unit, e.g. 24GB "
            "(10^9 bytes), 24GiB or 24G (2^30 bytes), 512MiB."
        )
    value = float(match.group(1)) * _UNITS[unit]
    if value < 1:
        raise ValueError(f"--mem-per-rank {text!r} must be positive, e.g. 24GB.")
    return int(value)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__.splitlines()[0].split(": ", 1)[1])
    p.add_argument("--model", required=True,
                   help="a Hugging Face config.json (or its folder), or a model name such as "
                        "gpt2-medium, llama-2-7b (see docs/plan.md)")  # fmt: skip
    p.add_argument("--nproc", type=int, required=True, help="processes (devices) per node")
    p.add_argument("--nnodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--mem-per-rank", required=True, metavar="SIZE",
                   help="device memory per rank: 24GB, 80GiB, 512MiB, ...")  # fmt: skip
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's "
                   "context, at most 2048)")  # fmt: skip
    p.add_argument(
        "--batch",
        type=int,
        help="sequences per forward and backward over all ranks (the global batch; with "
        "gradient accumulation, of one accumulation step; default: one per rank)",
    )
    p.add_argument("--precision", choices=("fp32", "fp16", "bf16"), default="bf16",
                   help="training precision (default bf16)")  # fmt: skip
    p.add_argument("--tp", type=int, help="only this tensor-parallel size for hybrid layouts")
    p.add_argument("--pp", type=int, help="only this pipeline size for hybrid layouts")
    p.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="whose optimizer and collective paths to model (default cuda)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _unit(budget: int) -> tuple[str, float]:
    """GiB for budgets from 4 GiB up, MiB below (small models stay readable)."""
    return ("GiB", 2.0**30) if budget >= 2**32 else ("MiB", 2.0**20)


def _render(plan: object) -> str:
    from kolossos.utils.profiling.model_params import count_parameters
    from kolossos.utils.profiling.planner import Plan

    assert isinstance(plan, Plan)
    req, best = plan.request, plan.recommended
    assert best is not None
    shape = req.shape
    unit, scale = _unit(req.budget)
    f = lambda v: f"{v / scale:.2f}"  # noqa: E731
    lines = [
        f"model {shape.name} ({shape.model_type}): {count_parameters(shape) / 1e6:,.1f}M "
        f"parameters, {shape.num_layers} layers, hidden {shape.hidden}, vocab {shape.vocab}",
        f"{req.world_size} ranks ({req.nnodes} x {req.nproc}), {f(req.budget)} {unit} per rank, "
        f"seq {req.seq_len}, global batch {req.batch}, {req.precision}, {req.device} paths",
        "",
        f"{'layout':<34} {'fits':>4} {'peak':>8} {'params':>8} {'grads':>8} {'optim':>8} "
        f"{'activ':>8} {'buffers':>8} {'host':>8} {'comm/step':>9}  ({unit} per rank)",
    ]
    for e in plan.estimates:
        m = e.memory
        lines.append(
            f"{e.layout.name:<34} {'yes' if e.fits else 'no':>4} {f(m.peak):>8} "
            f"{f(m.params):>8} {f(m.grads):>8} {f(m.optim):>8} {f(m.activations):>8} "
            f"{f(m.buffers):>8} {f(m.host):>8} {f(e.comm.total):>9}"
        )
    lay = best.layout
    lines += [
        "",
        f"{len(plan.fitting)} of {len(plan.estimates)} layouts fit. Recommended: {lay.name} "
        f"(peak {f(best.memory.peak)} {unit} at {best.memory.peak_phase}) -- {plan.reason()}",
        "",
        f"from kolossos.booster.plugin import {lay.plugin_call().split('(')[0]}",
        f"booster = {lay.booster_call()}",
    ]
    if lay.checkpointing:
        from kolossos.utils.profiling.layouts import CHECKPOINTING_CALL

        lines.append(f"{CHECKPOINTING_CALL}  # before booster.boost")
    if lay.pp > 1:
        lines.append("# train with booster.execute_pipeline(data_iter, model, criterion, "
                     "optimizer)")  # fmt: skip
    return "\n".join(lines)


def _over_budget(plan: object) -> str:
    from kolossos.utils.profiling.planner import Plan

    assert isinstance(plan, Plan)
    smallest = plan.estimates[0]
    over = smallest.memory.peak - plan.request.budget
    unit, scale = _unit(plan.request.budget)
    f = lambda v: f"{v / scale:.2f} {unit}"  # noqa: E731
    return (
        f"no layout fits in {f(plan.request.budget)} per rank: the smallest, "
        f"{smallest.layout.name} ({smallest.layout.plugin_call()}), needs "
        f"{f(smallest.memory.peak)}, {f(over)} over; add ranks or memory, or lower --batch / "
        "--seq-len."
    )


def main(argv: list[str]) -> int:
    """Run ``kolossos plan``; 0 with a recommendation, 2 on bad input or when nothing fits."""
    try:
        args = _parser().parse_args(argv)
    except _UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return exc.code if isinstance(exc.code, int) else 0
    from kolossos.utils.profiling.model_shape import load_model_shape
    from kolossos.utils.profiling.planner import PlanRequest, make_plan

    try:
        shape = load_model_shape(args.model)
        budget = parse_size(args.mem_per_rank)
        request = PlanRequest(
            shape=shape,
            nproc=args.nproc,
            nnodes=args.nnodes,
            budget=budget,
            seq_len=args.seq_len if args.seq_len is not None else shape.default_seq_len,
            batch=args.batch if args.batch is not None else args.nproc * args.nnodes,
            precision=args.precision,
            device=args.device,
            tp_size=args.tp,
            pp_size=args.pp,
        )
        plan = make_plan(request)
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    if plan.recommended is None:
        if args.json:
            print(json.dumps(plan.as_dict()))
        print(f"{PROG}: error: {_over_budget(plan)}", file=sys.stderr)
        return 2
    try:
        print(json.dumps(plan.as_dict()) if args.json else _render(plan), flush=True)
    except BrokenPipeError:  # e.g. | head: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
