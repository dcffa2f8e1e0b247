"""``kolossos train`` under ``hybrid_parallel`` with ``pp_size=2`` (and ZeRO-1) evaluates through
the pipeline's forward-only mode: on 2 ranks every validation loss, taken after every step,
equals ``torch_ddp``'s, and so do the training losses (the evaluations leave no gradient)."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from kolossos.testing import distributed
from kolossos.train import load_config
from kolossos.train.metrics import read_metrics
from kolossos.train.paths import RunPaths
from kolossos.train.tiny import make_tiny_checkpoint
from kolossos.train.worker import run_worker

pytestmark = pytest.mark.dist

ATOL = 2e-5  # fp32: the plugins differ only in how micro-batch sums are ordered
PIPELINE = ["plugin=hybrid_parallel", "plugin_kwargs.tp_size=1", "plugin_kwargs.pp_size=2",
            "plugin_kwargs.num_microbatches=2"]  # fmt: skip
RUNS = {
    "ddp": ["plugin=torch_ddp"],
    "pp2": PIPELINE,
    "pp2-zero1": [*PIPELINE, "plugin_kwargs.zero_stage=1"],
}


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pp-eval")
    rng = random.Random(0)
    words = ["the", "king", "queen", "lord", "love", "death", "night", "day", "sword", "crown"]
    data = root / "data.jsonl"
    lines = [json.dumps({"text": " ".join(rng.choices(words, k=24))}) for _ in range(24)]
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return make_tiny_checkpoint(root / "model", family="llama"), data


@distributed(2)
def test_pipeline_evaluation_is_forward_only(tmp_path: Path, llama: tuple[Path, Path]) -> None:
    model, data = llama
    common = [
        f"model.pretrained={model}", f"data.path={data}", "data.format=jsonl",
        "model.block_size=16", "train.steps=3", "train.batch_size=4", "train.lr=1e-2",
        "train.warmup_steps=0", "train.eval_interval=1", "train.eval_batches=2",
        "checkpoint.every=100", "sample.tokens=0", f"output_dir={tmp_path}",
    ]  # fmt: skip
    for name, extra in RUNS.items():
        config = load_config(None, [*common, f"name={name}", *extra])
        assert run_worker(config, stream=io.StringIO(), install_signals=False) == 0, name
        dist.barrier()
    if dist.get_rank() != 0:
        return
    logs = {n: read_metrics(RunPaths.of(str(tmp_path), n).metrics) for n in RUNS}
    series = {
        n: {k: [(r["step"], r[key]) for r in log if r["kind"] == k]
            for k, key in (("train", "loss"), ("val", "val_loss"))}
        for n, log in logs.items()
    }  # fmt: skip
    reference = series["ddp"]
    assert [s for s, _ in reference["val"]] == [0, 1, 2, 3]
    assert abs(reference["val"][0][1] - reference["val"][-1][1]) > 100 * ATOL  # it learned
    for name in ("pp2", "pp2-zero1"):
        for kind in ("train", "val"):
            got, want = series[name][kind], reference[kind]
            assert [s for s, _ in got] == [s for s, _ in want], (name, kind)
            torch.testing.assert_close([v for _, v in got], [v for _, v in want], atol=ATOL,
                                       rtol=0, msg=f"{name} {kind}")  # fmt: skip
