"""The ViT tutorial (§20.13, ``examples/legacy/vit_tutorial``) end to end on CPU processes:
data parallelism with the Trainer and its hooks (2 ranks), pipeline parallelism with the engine
loop (2 ranks), and 1D tensor x pipeline parallelism (4 ranks), each through
``kolossos run`` from an unrelated directory with the synthetic CIFAR-10 stand-in."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kolossos.testing import rerun_if_address_is_in_use
from kolossos.testing.network import free_port

REPO = Path(__file__).resolve().parents[2]
HERE = REPO / "examples" / "legacy" / "vit_tutorial"
TIMEOUT_S = 900  # only detects a hang: tests never gate on speed
NUM = r"[-+0-9.e]+|nan|inf"


def run(tmp_path: Path, nproc: int, script: str, config: str) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", DATA=str(tmp_path / "data"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    argv = [sys.executable, "-m", "kolossos.cli.main", "run", "--nproc_per_node", str(nproc)]
    argv += ["--master_port", str(free_port()), str(HERE / script)]
    argv += ["--config", str(HERE / "configs" / config)]
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


@rerun_if_address_is_in_use()
def test_vit_data_parallel_trainer_hooks(tmp_path: Path) -> None:
    out = run(tmp_path, 2, "train_dp.py", "config_data_parallel.py")
    train = re.findall(rf"\[Epoch (\d) / Train\]: Loss = ({NUM}) \| LR = ({NUM})$", out, re.M)
    test = re.findall(rf"\[Epoch (\d) / Test\]: Loss = ({NUM}) \| Accuracy = ({NUM})$", out, re.M)
    assert [t[0] for t in train] == ["0", "1"] and [t[0] for t in test] == ["0", "1"], out
    assert all(0 <= float(t[2]) <= 1 for t in test)
    # SaveCheckpointHook: one file per epoch, holding this model's weights
    for epoch in (0, 1):
        assert f"checkpoint for epoch {epoch} is saved to ckpt/epoch{epoch}.pt" in out
        state = torch.load(tmp_path / "ckpt" / f"epoch{epoch}.pt", weights_only=False)
        assert state["epoch"] == epoch and any("blocks" in k for k in state["model"]), state.keys()
    # TensorboardHook: event files, or a clear message that TensorBoard is missing
    if importlib.util.find_spec("tensorboard") is not None:
        assert list((tmp_path / "tb_logs").rglob("events.out.tfevents.*")), out
    else:
        assert "TensorboardHook skipped: TensorboardHook needs the TensorBoard package, which " \
               "is not installed: pip install tensorboard" in out  # fmt: skip
    assert "gradients reduced by torch DistributedDataParallel" in out


def _stage_params(out: str) -> dict[int, int]:
    found = re.findall(r"number of parameters: (\d+) on pipeline stage (\d)", out)
    return {int(stage): int(n) for n, stage in found}


def _epoch_losses(out: str) -> dict[int, list[float]]:
    losses: dict[int, list[float]] = {}
    for rank, epoch, loss in re.findall(rf"\[rank (\d)\] Epoch (\d) - train loss: ({NUM}),", out):
        losses.setdefault(int(rank), []).append(float(loss))
        assert len(losses[int(rank)]) == int(epoch) + 1
    return losses


@pytest.mark.parametrize("tp", [1, 2])
@rerun_if_address_is_in_use()
def test_vit_pipeline_and_hybrid(tmp_path: Path, tp: int) -> None:
    config = "config_pipeline_parallel.py" if tp == 1 else "config_hybrid_parallel.py"
    out = run(tmp_path, 2 * tp, "train_hybrid.py", config)
    assert "Rank0 build layer 0-2, 2/4 layers" in out and f"Rank{tp} build layer 2-4" in out
    params = _stage_params(out)
    # 1D TP halves the attention and MLP weights of each stage
    expected = {0: 23840, 1: 17482} if tp == 1 else {0: 15488, 1: 9130}
    assert params == expected, out
    losses = _epoch_losses(out)
    last_stage = [2, 3] if tp == 2 else [1]
    assert sorted(losses) == last_stage, out  # the loss lives on the last stage only
    first = losses[last_stage[0]]
    assert len(first) == 2 and all(v == v and v < 10 for v in first)
    for rank in last_stage[1:]:  # tensor ranks of the last stage agree
        assert losses[rank] == first
