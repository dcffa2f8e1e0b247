"""The process ``kolossos benchmark`` starts on every rank (``torchrun --module``).

It reads the job file the command wrote (options and layouts), and for each layout launches
kolossos with that layout's ``parallel`` config (the first launch creates the process group, the
later ones reuse it and only build the layout's groups), measures it
(:func:`~kolossos.cli.benchmark.measure.measure_layout`), gathers every rank's figures and, on
rank 0, rewrites the results file after each layout (atomically), so a crash keeps what was
measured. A layout that raises is recorded with its error and the next one runs.

Usage (the command does this)::

    torchrun --nproc_per_node 4 --module kolossos.cli.benchmark.worker --job job.json --out r.json
"""

from __future__ import annotations

import argparse
import json
import os
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist

import kolossos
from kolossos.accelerator import get_accelerator
from kolossos.cli.benchmark.layouts import Layout
from kolossos.cli.benchmark.measure import RankMeasurement, measure_layout
from kolossos.cli.benchmark.options import BenchmarkOptions
from kolossos.utils.profiling.memory import gather_from_ranks

__all__ = ["main", "run_layouts"]


def _error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return text[0][:400] if text else type(exc).__name__


def _launch(layout: Layout, seed: int) -> None:
    with warnings.catch_warnings():
        # the second and later launches reuse the default group on purpose
        warnings.filterwarnings("ignore", message=".*already initialised.*")
        kolossos.launch_from_torch(
            config={"parallel": layout.parallel_config()}, seed=seed, verbose=False
        )


def _run_one(layout: Layout, options: BenchmarkOptions) -> list[dict[str, Any]]:
    """Every rank's figures (or errors) for ``layout``; COLLECTIVE over the world."""
    try:
        _launch(layout, options.seed)
        mine = measure_layout(layout, options)
    except Exception as exc:  # recorded, and the next layout runs
        mine = RankMeasurement(error=_error(exc))
    # SYNC POINT: every rank's figures, for rank 0's report
    return list(gather_from_ranks(mine.as_dict()))


def _write(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


def _environment() -> dict[str, Any]:
    accelerator = get_accelerator()
    device = accelerator.get_current_device()
    name = accelerator.get_device_name() if device.type != "cpu" else "cpu"
    backend = str(dist.get_backend()) if dist.is_initialized() else "none"
    return {"backend": backend, "device": device.type, "device_name": name}


def run_layouts(
    layouts: list[Layout], options: BenchmarkOptions, out: Path | None
) -> list[dict[str, Any]]:
    """Measure every layout in turn; rank 0 (``out`` given) rewrites ``out`` after each.

    Returns:
        One entry per layout: its description and every rank's figures.
    """
    done: list[dict[str, Any]] = []
    for layout in layouts:
        ranks = _run_one(layout, options)
        done.append({"layout": layout.as_dict(), "ranks": ranks})
        if out is not None:
            _write(out, {"environment": _environment(), "results": done})
    return done


def main(argv: list[str] | None = None) -> int:
    """Run the job file's layouts on this rank; rank 0 writes the results file."""
    parser = argparse.ArgumentParser(prog="kolossos.cli.benchmark.worker")
    parser.add_argument("--job", required=True, type=Path, help="the command's job file")
    parser.add_argument("--out", required=True, type=Path, help="results file (rank 0 writes)")
    args = parser.parse_args(argv)
    job = json.loads(args.job.read_text())
    options = BenchmarkOptions.from_dict(job["options"])
    layouts = [Layout.from_dict(entry) for entry in job["layouts"]]
    rank = int(os.environ.get("RANK", "0"))
    run_layouts(layouts, options, args.out if rank == 0 else None)
    if dist.is_initialized():
        dist.barrier()  # SYNC POINT: rank 0 has written the results before anyone leaves
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
