"""The pipeline-building tutorials of the legacy generation run under ``kolossos run`` on 2
processes, as a user starts them: §20.14 (``examples/legacy/vit_pipeline_sequential``: a ViT as
``nn.Sequential`` split by ``build_pipeline_model``) and §20.15
(``examples/legacy/resnet_pipelinable``: a ResNet built inside ``PipelinableContext`` and split
by its ``exec_seq``), each trained with the Trainer and its hooks on synthetic CIFAR-10."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from kolossos.testing import rerun_if_address_is_in_use
from kolossos.testing.network import free_port

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 900  # only detects a hang: tests never gate on speed
NUM = r"[-+0-9.e]+|nan|inf"


def run_example(name: str, tmp_path: Path) -> str:
    """Run ``examples/legacy/<name>/train.py`` on 2 local processes from an unrelated directory."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", DATA=str(tmp_path / "data"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    argv = [sys.executable, "-m", "kolossos.cli.main", "run", "--nproc_per_node", "2"]
    argv += ["--master_port", str(free_port()), str(REPO / "examples/legacy" / name / "train.py")]
    done = subprocess.run(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT_S,
                          check=False)  # fmt: skip
    assert done.returncode == 0, f"exit code {done.returncode}\n{done.stdout}"
    return done.stdout


def check_trainer_output(out: str) -> None:
    """Both epochs trained and tested on the last stage (rank 1), 8 finite steps."""
    train = re.findall(rf"\[rank 1\] \[Epoch (\d) / Train\]: Loss = ({NUM})", out)
    test = re.findall(rf"\[rank 1\] \[Epoch (\d) / Test\]: Loss = ({NUM}) \| Accuracy = ({NUM})",
                      out)  # fmt: skip
    assert [t[0] for t in train] == ["0", "1"] and [t[0] for t in test] == ["0", "1"], out
    assert all(0 <= float(t[2]) <= 1 for t in test)
    assert re.search(rf"last stage trained 8 steps, losses ({NUM}) -> ({NUM})", out), out


@rerun_if_address_is_in_use()
def test_vit_from_sequential_example(tmp_path: Path) -> None:
    out = run_example("vit_pipeline_sequential", tmp_path)
    check_trainer_output(out)
    # build_pipeline_model(verbose=True): 6 layers (embedding, 4 blocks, head), 3 per stage
    assert "Total 6 layers" in out
    assert "stage=0, chunk=0, layers=[0-3)" in out and "stage=1, chunk=0, layers=[3-6)" in out


@rerun_if_address_is_in_use()
def test_resnet_with_pipelinable_context_example(tmp_path: Path) -> None:
    out = run_example("resnet_pipelinable", tmp_path)
    check_trainer_output(out)
    first = re.search(r"pipeline rank 0 holds \[(.*)\]", out)
    last = re.search(r"pipeline rank 1 holds \[(.*)\]", out)
    assert first and last, out
    names = [n.strip(" '") for n in (first.group(1) + ", " + last.group(1)).split(",")]
    assert names == ["conv1", "bn1", "relu", "maxpool", "layer1", "layer2", "layer3", "layer4",
                     "avgpool", "fc"]  # fmt: skip
    assert "LR = 0.001" in out and "LR = 0" in out  # LinearWarmupLR through LRSchedulerHook
