"""``python -m benchmarks.narrow_grads`` end to end at toy size: every engine runs both ways, and
the memory it reports follows from the design (never timings): ZeRO's step allocates its
partitions' fp32 copies only with fp32 gradients, Gemini's bf16 gradient shards are half the size
of the fp32 ones."""

from __future__ import annotations

import json

from kolossos.testing.processes import run_module

HANG_S = 900  # a hang detector: about 20 s on an idle 2-core machine


def test_both_ways_for_every_engine() -> None:
    proc = run_module("benchmarks.narrow_grads", "--layers", "1", "--hidden", "64", "--steps",
                      "1", timeout=HANG_S)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])["rows"]
    engines = ("zero1", "zero2", "gemini")
    assert set(rows) == {f"{e}/{g}" for e in engines for g in ("fp32", "narrow")}
    for stage in ("zero1", "zero2"):  # the fp32 copies (6.2 MiB) against one 1 MiB scratch piece
        assert rows[f"{stage}/narrow"]["step_alloc_mib"] < rows[f"{stage}/fp32"]["step_alloc_mib"]
    fp32, narrow = rows["gemini/fp32"]["grads_mib"], rows["gemini/narrow"]["grads_mib"]
    assert fp32 > 0 and abs(narrow - fp32 / 2) < 1e-6 * fp32
