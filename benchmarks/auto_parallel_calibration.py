"""What ``autoparallelize``'s own calibration costs (``cost_model=None``) and what it finds.

Run ``python -m benchmarks.auto_parallel_calibration`` (spawns 2 and then 4 gloo ranks). On
each rank, ``TRIALS`` times: the matmul rate agreed over the ranks (the slowest,
:func:`~kolossos.auto_parallel.autoparallelize.measure_flops_rate`) and the contention factor
within its default time (:func:`~kolossos.auto_parallel.calibrate.calibrate_contention`, for
the GPT-2 of ``benchmarks.auto_parallel_gpt2``'s ``gpt2-l4-h256``: 4 x 64 tokens ÷ ranks,
hidden 256), each timed on the slowest rank. Prints one markdown row per world size.
"""

from __future__ import annotations

import argparse
import time

import torch

__all__ = ["main"]

TRIALS = 5
TOKENS, HIDDEN = 4 * 64, 256


def _rank(rank: int, world_size: int, port: int) -> list[tuple[float, float, float]]:
    import kolossos
    from kolossos.auto_parallel.autoparallelize import measure_flops_rate
    from kolossos.auto_parallel.calibrate import calibrate_contention, slowest

    kolossos.launch(config={}, rank=rank, world_size=world_size, host="127.0.0.1", port=port,
                    backend="gloo", seed=0, verbose=False)  # fmt: skip
    torch.set_num_threads(1)
    rows = []
    for _ in range(TRIALS):
        start = time.perf_counter()
        slowest(1.0 / measure_flops_rate())
        rate_s = slowest(time.perf_counter() - start)
        start = time.perf_counter()
        factor = calibrate_contention(TOKENS // world_size, HIDDEN)
        rows.append((rate_s, slowest(time.perf_counter() - start), factor))
    return rows


def main() -> None:
    """Print the cost and the factor of the default calibration at 2 and 4 ranks."""
    from kolossos.testing.spawn import spawn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, action="append")
    args = parser.parse_args()
    print("| ranks | matmul rate s (max of trials) | contention s (min / max of trials) | "
          "factors |")  # fmt: skip
    print("|---|---|---|---|")
    for world_size in args.ranks or (2, 4):
        rows = spawn(_rank, world_size)[0]
        probe = [r[1] for r in rows]
        factors = ", ".join(f"{r[2]:.2f}" for r in rows)
        print(f"| {world_size} | {max(r[0] for r in rows):.3f} | {min(probe):.2f} / "
              f"{max(probe):.2f} | {factors} |")  # fmt: skip


if __name__ == "__main__":
    main()
