"""``kolossos train`` fine-tuning a local tiny LLaMA checkpoint on 2 ranks under every plugin:
each run starts from the same pretrained weights and trains on the same packed batches, so in
fp32 every plugin must log the loss of the plain DDP run at every step and end with its
weights (gathered from the checkpoint), which training moved far beyond the tolerance."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from transformers import LlamaForCausalLM  # noqa: F401  (imported once, before forking)

from kolossos.testing import distributed
from kolossos.testing.parity import assert_moved, snapshot
from kolossos.train import load_config
from kolossos.train.export import load_run_model
from kolossos.train.metrics import read_metrics
from kolossos.train.paths import RunPaths
from kolossos.train.tiny import make_tiny_checkpoint
from kolossos.train.worker import run_worker

pytestmark = pytest.mark.dist

STEPS = 3
ATOL = 2e-5
#: run name -> overrides; every plugin, the options each combines with
RUNS: dict[str, list[str]] = {
    "ddp": ["plugin=torch_ddp"],
    "ddp-accum-ckpt": [
        "plugin=torch_ddp",
        "train.gradient_accumulation=2",
        "model.activation_checkpointing=true",
    ],
    "zero2": ["plugin=low_level_zero", "plugin_kwargs.stage=2"],
    "gemini": ["plugin=gemini"],
    "fsdp": ["plugin=torch_fsdp"],
    "tp2-ckpt": [
        "plugin=hybrid_parallel",
        "plugin_kwargs.tp_size=2",
        "model.activation_checkpointing=true",
    ],
    "pp2": [
        "plugin=hybrid_parallel",
        "plugin_kwargs.tp_size=1",
        "plugin_kwargs.pp_size=2",
        "plugin_kwargs.num_microbatches=2",
    ],
    "dp-zero1": ["plugin=hybrid_parallel", "plugin_kwargs.tp_size=1", "plugin_kwargs.zero_stage=1"],
    "pp2-zero1": [
        "plugin=hybrid_parallel",
        "plugin_kwargs.tp_size=1",
        "plugin_kwargs.pp_size=2",
        "plugin_kwargs.num_microbatches=2",
        "plugin_kwargs.zero_stage=1",
    ],
}
#: low-precision runs: they must follow the fp32 losses loosely
LOW_PRECISION: dict[str, list[str]] = {
    "zero2-bf16": ["plugin=low_level_zero", "mixed_precision=bf16"],
    "tp2-bf16": ["plugin=hybrid_parallel", "plugin_kwargs.tp_size=2", "mixed_precision=bf16"],
}
LOW_ATOL = 0.05


def write_data(folder: Path) -> Path:
    """JSON Lines with a text field: enough for a few packed batches of 16 tokens."""
    rng = random.Random(0)
    words = ["the", "king", "queen", "lord", "love", "death", "night", "day", "sword", "crown"]
    path = folder / "data.jsonl"
    lines = [json.dumps({"text": " ".join(rng.choices(words, k=24))}) for _ in range(24)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny LLaMA folder (with its tokenizer) and a JSONL data file."""
    root = tmp_path_factory.mktemp("tiny-llama")
    return make_tiny_checkpoint(root / "model", family="llama"), write_data(root)


def _config(tmp_path: Path, model: Path, data: Path, name: str, extra: list[str]) -> Any:
    return load_config(
        None,
        [
            f"model.pretrained={model}",
            f"data.path={data}",
            "data.format=jsonl",
            "model.block_size=16",
            f"train.steps={STEPS}",
            "train.batch_size=4",
            "train.lr=1e-2",
            "train.warmup_steps=0",
            "train.eval_interval=100",
            "train.eval_batches=1",
            "checkpoint.every=100",
            "sample.tokens=0",
            f"output_dir={tmp_path}",
            f"name={name}",
            *extra,
        ],
    )


def _losses(tmp_path: Path, name: str) -> list[float]:
    records = read_metrics(RunPaths.of(str(tmp_path), name).metrics)
    return [r["loss"] for r in records if r["kind"] == "train"]


@distributed(2)
def test_every_plugin_fine_tunes_the_same(tmp_path: Path, llama: tuple[Path, Path]) -> None:
    model_dir, data = llama
    for name, extra in {**RUNS, **LOW_PRECISION}.items():
        config = _config(tmp_path, model_dir, data, name, extra)
        assert run_worker(config, stream=io.StringIO(), install_signals=False) == 0, name
        dist.barrier()
    if dist.get_rank() != 0:
        return
    reference = _losses(tmp_path, "ddp")
    assert len(reference) == STEPS
    from transformers import AutoModelForCausalLM

    start = snapshot(AutoModelForCausalLM.from_pretrained(str(model_dir)).named_parameters())
    final = snapshot(load_run_model(tmp_path / "ddp").model.named_parameters())
    assert_moved(start, final, ATOL)
    for name in RUNS:
        losses = _losses(tmp_path, name)
        torch.testing.assert_close(losses, reference, atol=ATOL, rtol=0, msg=name)
        trained = snapshot(load_run_model(tmp_path / name).model.named_parameters())
        for key, value in final.items():
            torch.testing.assert_close(trained[key], value, atol=ATOL, rtol=0, msg=f"{name} {key}")
    for name in LOW_PRECISION:
        losses = _losses(tmp_path, name)
        torch.testing.assert_close(losses, reference, atol=LOW_ATOL, rtol=0, msg=name)
        trained = snapshot(load_run_model(tmp_path / name).model.named_parameters())
        assert_moved(start, trained, ATOL)


#: 4-process runs: every data-parallel plugin, and the model split 2 x 2 (tp x pp) or tp x (dp ZeRO)
RUNS_4: dict[str, list[str]] = {
    "ddp4": ["plugin=torch_ddp"],
    "zero2-4": ["plugin=low_level_zero", "plugin_kwargs.stage=2"],
    "gemini4": ["plugin=gemini"],
    "fsdp4": ["plugin=torch_fsdp"],
    "tp2-pp2": [
        "plugin=hybrid_parallel",
        "plugin_kwargs.tp_size=2",
        "plugin_kwargs.pp_size=2",
        "plugin_kwargs.num_microbatches=2",
    ],
    "tp2-dp2-zero1": [
        "plugin=hybrid_parallel",
        "plugin_kwargs.tp_size=2",
        "plugin_kwargs.zero_stage=1",
    ],
}


@distributed(4)
def test_four_processes_fine_tune_the_same(tmp_path: Path, llama: tuple[Path, Path]) -> None:
    model_dir, data = llama
    for name, extra in RUNS_4.items():
        config = _config(tmp_path, model_dir, data, name, [*extra, "nproc_per_node=4"])
        assert run_worker(config, stream=io.StringIO(), install_signals=False) == 0, name
        dist.barrier()
    if dist.get_rank() != 0:
        return
    reference = _losses(tmp_path, "ddp4")
    assert len(reference) == STEPS
    from transformers import AutoModelForCausalLM

    start = snapshot(AutoModelForCausalLM.from_pretrained(str(model_dir)).named_parameters())
    final = snapshot(load_run_model(tmp_path / "ddp4").model.named_parameters())
    assert_moved(start, final, ATOL)
    for name in RUNS_4:
        torch.testing.assert_close(_losses(tmp_path, name), reference, atol=ATOL, rtol=0, msg=name)
        trained = snapshot(load_run_model(tmp_path / name).model.named_parameters())
        for key, value in final.items():
            torch.testing.assert_close(trained[key], value, atol=ATOL, rtol=0, msg=f"{name} {key}")
