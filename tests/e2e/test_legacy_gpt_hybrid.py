"""The GPT hybrid-parallel tutorial (§20.16, ``examples/legacy/gpt_hybrid``) end to end on CPU
processes: pipeline 2 (``PipelineSchedule``), pipeline 2 x 1D tensor 2 on 4 ranks, and the
interleaved schedule (``NUM_CHUNKS = 2``), with the word embedding tied to the LM head across
the stages, the loose-JSON web-text stand-in and the shipped GPT-2-format vocabulary.

The 1D tensor-parallel run builds the same model from the same seed (the 1D layers keep slices
of full-size draws), so its final loss equals the pipeline-only run's up to float rounding."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from kolossos.testing import rerun_if_address_is_in_use
from kolossos.testing.network import free_port

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "legacy" / "gpt_hybrid" / "train_gpt.py"
TIMEOUT_S = 900  # only detects a hang
NUM = r"[-+0-9.e]+|nan|inf"


def run(tmp_path: Path, nproc: int, *flags: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("DATA", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    argv = [sys.executable, "-m", "kolossos.cli.main", "run", "--nproc_per_node", str(nproc)]
    argv += ["--master_port", str(free_port()), str(SCRIPT), *flags]
    done = subprocess.run(
        argv,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, f"exit code {done.returncode}\n{done.stdout}"
    return done.stdout


def _final(out: str) -> dict[int, float]:
    return {
        int(r): float(v) for r, v in re.findall(rf"\[rank (\d)\] final train loss ({NUM})", out)
    }


@rerun_if_address_is_in_use()
def test_gpt_hybrid_tutorial(tmp_path: Path) -> None:
    pp = run(tmp_path, 2)
    assert "schedule: PipelineSchedule" in pp
    assert "Rank0 build layer 0-2, 2/4 layers" in pp and "Rank1 build layer 2-4, 2/4 layers" in pp
    epochs = re.findall(rf"\[Epoch (\d) / Train\]: Loss = ({NUM}) \| Throughput = ({NUM})", pp)
    assert [e[0] for e in epochs] == ["0", "1"], pp
    assert (tmp_path / "data" / "webtext" / "gpt_webtext_16.pt").is_file()  # the cache
    final_pp = _final(pp)
    assert list(final_pp) == [1]

    hybrid = run(tmp_path, 4, "--tp", "2")  # reuses the cached encoding
    final_tp = _final(hybrid)
    assert sorted(final_tp) == [2, 3] and final_tp[2] == final_tp[3]
    assert abs(final_tp[2] - final_pp[1]) < 1e-3, (final_tp, final_pp)

    interleaved = run(tmp_path, 2, "--num_chunks", "2")
    assert "schedule: InterleavedPipelineSchedule" in interleaved
    assert "Rank0 build layer 0-1, 1/4 layers" in interleaved
    assert "Rank0 build layer 2-3, 1/4 layers" in interleaved
    assert list(_final(interleaved)) == [1]
