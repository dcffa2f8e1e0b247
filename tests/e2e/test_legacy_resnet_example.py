"""The §20.9 example (``examples/legacy/resnet_engine_trainer``: ResNet-34 on CIFAR-10 shaped data
with the legacy Engine loop, then the Trainer and the tutorial's hooks) runs under
``kolossos run --nproc_per_node 2`` and prints the tutorial's lines, once (rank 0)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from kolossos.testing import rerun_if_address_is_in_use
from kolossos.testing.network import free_port

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "legacy" / "resnet_engine_trainer" / "train.py"
TIMEOUT_S = 900  # only detects a hang: tests never gate on speed
NUM = r"[-+0-9.e]+|nan|inf"


def run_example(tmp_path: Path) -> str:
    """Run the example on 2 local processes from an unrelated directory; return its output."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", DATA=str(tmp_path / "data"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    argv = [sys.executable, "-m", "kolossos.cli.main", "run", "--nproc_per_node", "2"]
    argv += ["--master_port", str(free_port()), str(SCRIPT)]
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
def test_resnet_engine_trainer_example(tmp_path: Path) -> None:
    out = run_example(tmp_path)
    # (a) the engine loop: one line per epoch (config.py: NUM_EPOCHS = 2), from rank 0
    engine = re.findall(
        rf"\[rank 0\] Epoch (\d+) - train loss: ({NUM}), test loss: ({NUM}), acc: ({NUM}), "
        rf"lr: ({NUM})$",
        out,
        flags=re.MULTILINE,
    )
    assert [int(e[0]) for e in engine] == [0, 1], out
    assert float(engine[0][4]) == 0.05 and float(engine[1][4]) == 0  # cosine over 2 epochs
    assert all(0 <= float(e[3]) <= 1 for e in engine)
    # (b) the trainer's hooks: metrics and memory per epoch, once
    train = re.findall(rf"\] \[Epoch (\d)+ / Train\]: Loss = ({NUM}) \| LR = ({NUM})$", out, re.M)
    test = re.findall(
        rf"\] \[Epoch (\d)+ / Test\]: Loss = ({NUM}) \| Accuracy = ({NUM})$", out, re.M
    )
    assert [t[0] for t in train] == ["0", "1"] and [t[0] for t in test] == ["0", "1"], out
    assert [float(t[2]) for t in train] == [0.05, 0.0]
    assert all(0 <= float(t[2]) <= 1 for t in test)
    memory = re.findall(r"\] (Before-train|\[Epoch \d / (?:Train|Test)\]): \w+ .*MB", out)
    assert memory == ["Before-train", "[Epoch 0 / Train]", "[Epoch 0 / Test]",
                      "[Epoch 1 / Train]", "[Epoch 1 / Test]"], out  # fmt: skip
    assert "Using LRSchedulerHook for training, priority = 1" in out
    assert "[Epoch 1 / Train]" in out.split("Training with the trainer")[1]  # the progress bar
    assert out.count("Training finished") == 1
    assert not list(Path(SCRIPT).parent.glob("*.pt"))  # nothing written into the repository
