"""From the ranks' raw measurements to report rows: throughput, step-time statistics, memory and
traffic per rank beside their closed-form estimates, MFU, and throughput ratios to baselines."""

from __future__ import annotations

import datetime as _dt
import platform
import statistics
from typing import Any

import torch

from benchmarks.contenders import Contender, Context
from benchmarks.harness import JobPlan
from benchmarks.models import ModelSpec
from kolossos.utils.profiling import comm_bytes_per_rank, model_state_bytes

__all__ = ["GPU_PEAKS", "add_ratios", "assemble_rows", "base_row", "peak_tflops"]

#: dense peak TFLOP/s per GPU model: (substring of the device name, fp32 (no TF32), bf16)
GPU_PEAKS: tuple[tuple[str, float, float], ...] = (
    ("H200", 67.0, 989.4),
    ("H100 PCIe", 51.2, 756.5),
    ("H100", 67.0, 989.4),  # SXM / HBM3
    ("A100", 19.5, 312.0),
    ("L40S", 91.6, 362.1),
    ("A10G", 31.2, 70.0),
)


def peak_tflops(
    device_name: str, precision: str, override: float | None
) -> tuple[float | None, str]:
    """Peak TFLOP/s of one device assumed for MFU, and a description of where it came from."""
    if override is not None:
        return override, f"--peak-tflops {override:g}"
    for key, fp32, bf16 in GPU_PEAKS:
        if key in device_name:
            value = bf16 if precision == "bf16" else fp32
            kind = "bf16 dense tensor-core" if precision == "bf16" else "fp32 (TF32 off)"
            return value, f"{key} {kind} peak, {value:g} TFLOP/s per device"
    return None, "no peak known for this device (pass --peak-tflops)"


def base_row(
    suite: str, spec: ModelSpec, contender: Contender, plan: JobPlan, world_size: int
) -> dict[str, Any]:
    """The fields every row has, whatever its status."""
    return {
        "suite": suite,
        "model": spec.name,
        "name": contender.name,
        "role": contender.role,
        "description": contender.description,
        "status": "ok",
        "reason": None,
        "world_size": world_size,
        "ranks": 1 if contender.single else world_size,
        "precision": plan.precision,
        "batch_per_rank": plan.batch,
        "seq_len": spec.seq_len,
        "unit": spec.unit,
        "steps": plan.steps,
        "warmup": plan.warmup,
        "reps": plan.reps,
        "interleave": plan.interleave,
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "host": platform.node(),
        "torch": torch.__version__,
    }


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo, hi = int(pos), min(int(pos) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _timing(entries: list[list[Any]], units_per_step: int) -> dict[str, Any]:
    """``entries[rep][rank]``: ``{"wall": [...], "cpu": [...]}`` per timed step, or ``None``.

    A step lasts as long as its slowest rank; its CPU cost is the sum over ranks. A repetition's
    throughput is its units over the sum of its step times.
    """
    reps: list[float] = []
    walls: list[float] = []
    cpus: list[float] = []
    for per_rank in entries:
        done = [e for e in per_rank if e is not None]
        step_wall = [max(col) for col in zip(*(e["wall"] for e in done), strict=True)]
        step_cpu = [sum(col) for col in zip(*(e["cpu"] for e in done), strict=True)]
        reps.append(units_per_step * len(step_wall) / sum(step_wall))
        walls += step_wall
        cpus += step_cpu
    median = statistics.median(walls)
    p10, p90 = _quantile(walls, 0.1), _quantile(walls, 0.9)
    return {
        "throughput": statistics.median(reps),
        "throughput_reps": reps,
        "step_time_s": {"median": median, "p10": p10, "p90": p90, "spread": (p90 - p10) / median},
        "cpu_s_per_step": statistics.median(cpus),
        "slots": {
            "throughput": [units_per_step / w for w in walls],
            "cpu_per_unit": [c / units_per_step for c in cpus],
        },
    }


def _memory(accounts: list[Any], estimate: float) -> dict[str, Any]:
    mems = [a["memory"] for a in accounts]
    states = [m["model_states"] for m in mems]
    return {
        "source": mems[0]["source"],
        "model_states_per_rank": states,
        "resident_after_step_per_rank": [m["resident"] for m in mems],
        "peak_per_rank": [m["peak"] for m in mems],
        "breakdown_rank0": mems[0]["breakdown"],
        "estimate_model_states": estimate,
        "model_states_vs_estimate": max(states) / estimate if estimate else None,
    }


def _comm(accounts: list[Any], formula: float) -> dict[str, Any]:
    comms = [a["comm_per_step"] for a in accounts]
    wire = [c["wire_bytes"] for c in comms]
    by_kind: dict[str, float] = {}
    for kinds in comms[0]["by_group"].values():
        for kind, stats in kinds.items():
            by_kind[kind] = by_kind.get(kind, 0.0) + stats["bytes"]
    return {
        "bytes_per_step": comms[0]["bytes"],
        "sent_bytes_per_step": comms[0]["sent_bytes"],
        "wire_bytes_per_step_per_rank": wire,
        "formula_bytes_per_step": formula,
        "wire_vs_formula": (wire[0] / formula) if formula and wire[0] is not None else None,
        "calls_per_step": comms[0]["calls"],
        "bytes_by_kind": by_kind,
        "by_group_rank0": comms[0]["by_group"],
    }


def assemble_rows(
    raw: dict[str, Any],
    plan: JobPlan,
    contenders: list[Contender],
    rows: dict[str, dict[str, Any]],
    ctx: Context,
    peak_override: float | None,
) -> None:
    """Fill the rows of the contenders that ran (``rows`` by name, from :func:`base_row`)."""
    per_rank = raw["per_rank"]
    num_params = int(raw["num_params"])
    peak, peak_note = peak_tflops(raw["device_name"], plan.precision, peak_override)
    for contender in contenders:
        row = rows[contender.name]
        ranks = row["ranks"]
        units = plan.batch * ranks * ctx.spec.seq_len
        entries = [
            [r["timings"][contender.name][rep] for r in per_rank] for rep in range(plan.reps)
        ]
        row.update(_timing(entries, units))
        accounts = [r["accounts"][contender.name] for r in per_rank]
        accounts = [a for a in accounts if a is not None]
        pbytes = contender.precision_bytes(ctx)
        strategy = contender.state_strategy or contender.strategy
        estimate = model_state_bytes(num_params, strategy, ranks, pbytes).total
        formula = comm_bytes_per_rank(num_params, contender.strategy, ranks, int(pbytes.grad))
        row.update(
            params=num_params,
            device=raw["device"],
            device_name=raw["device_name"],
            backend=raw["backend"],
            memory=_memory(accounts, estimate),
            comm=_comm(accounts, formula),
        )
        samples_per_s = row["throughput"] / ctx.spec.seq_len
        flops_per_s = raw["flops_per_step_rank"] / plan.batch * samples_per_s
        row["samples_per_s"] = samples_per_s
        row["model_tflops_per_s"] = flops_per_s / 1e12
        row["peak_tflops"], row["peak_note"] = peak, peak_note
        row["mfu"] = flops_per_s / (peak * 1e12 * ranks) if peak else None


def _paired(numerators: list[float], denominators: list[float]) -> dict[str, float]:
    pairs = [a / b for a, b in zip(numerators, denominators, strict=True)]
    return {
        "median": statistics.median(pairs),
        "p10": _quantile(pairs, 0.1),
        "p90": _quantile(pairs, 0.9),
        "pairs": len(pairs),
    }


def add_ratios(
    rows: list[dict[str, Any]], references: tuple[str, ...], counterparts: dict[str, str]
) -> None:
    """Ratios of each row to the suite's references and to its own counterpart baseline.

    Step ``j`` of repetition ``i`` of the row is paired with the same step of the baseline (they
    ran seconds apart with ``--interleave step``): ``ratios[base]`` is the median and the 10th /
    90th percentiles of the paired throughput ratios (> 1: the row is faster), ``cpu_ratios[base]``
    the same for CPU seconds per unit (> 1: the row costs less CPU).
    """
    by_name = {r["name"]: r for r in rows if r["status"] == "ok"}
    for row in rows:
        row["ratios"], row["cpu_ratios"] = {}, {}
        if row["status"] != "ok":
            continue
        wanted = [*references, counterparts.get(row["name"], "")]
        for base in dict.fromkeys(w for w in wanted if w and w != row["name"]):
            ref = by_name.get(base)
            if ref is None:
                continue
            mine, theirs = row["slots"], ref["slots"]
            row["ratios"][base] = _paired(mine["throughput"], theirs["throughput"])
            row["cpu_ratios"][base] = _paired(theirs["cpu_per_unit"], mine["cpu_per_unit"])
