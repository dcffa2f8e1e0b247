"""Interoperability with Hugging Face transformers: each side loads what the other saved."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from kolossos.checkpoint_io import GeneralCheckpointIO

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


def tiny_gpt2(seed: int) -> Any:
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=2,
        vocab_size=96,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config).eval()


def logits(model: Any) -> torch.Tensor:
    ids = torch.arange(24).reshape(2, 12) % 96
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("use_safetensors", [True, False])
def test_transformers_loads_our_sharded_checkpoint(tmp_path: Path, use_safetensors: bool) -> None:
    model = tiny_gpt2(0)
    GeneralCheckpointIO().save_model(
        model, tmp_path / "gpt2", shard=True, size_per_shard=0.1, use_safetensors=use_safetensors
    )
    names = sorted(os.listdir(tmp_path / "gpt2"))
    base, ext = ("model", ".safetensors") if use_safetensors else ("pytorch_model", ".bin")
    assert "config.json" in names and f"{base}{ext}.index.json" in names
    shards = [n for n in names if n.endswith(ext)]
    assert len(shards) > 1 and shards[0] == f"{base}-00001-of-{len(shards):05d}{ext}"
    config = json.loads((tmp_path / "gpt2" / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["model_type"] == "gpt2"

    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2").eval()
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    torch.testing.assert_close(logits(loaded), logits(model), rtol=0, atol=0)
    auto = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2").eval()
    torch.testing.assert_close(logits(auto), logits(model), rtol=0, atol=0)


def test_we_load_what_transformers_saved(tmp_path: Path) -> None:
    model = tiny_gpt2(0)
    model.save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    assert "lm_head.weight" not in index["weight_map"]  # tied: stored once

    ours = tiny_gpt2(1)
    assert not torch.equal(logits(ours), logits(model))
    report = GeneralCheckpointIO().load_model(ours, tmp_path / "hf")  # strict
    assert report.ok
    torch.testing.assert_close(logits(ours), logits(model), rtol=0, atol=0)


def test_transformers_unsharded_directory(tmp_path: Path) -> None:
    model = tiny_gpt2(0)
    model.save_pretrained(tmp_path / "hf")  # one model.safetensors
    ours = tiny_gpt2(1)
    GeneralCheckpointIO().load_model(ours, tmp_path / "hf")
    torch.testing.assert_close(logits(ours), logits(model), rtol=0, atol=0)

    (tmp_path / "mine").mkdir()  # shard=False into a directory: Hugging Face's unsharded layout
    GeneralCheckpointIO().save_model(ours, tmp_path / "mine", use_safetensors=True)
    assert sorted(os.listdir(tmp_path / "mine")) == ["config.json", "model.safetensors"]
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "mine").eval()
    torch.testing.assert_close(logits(loaded), logits(model), rtol=0, atol=0)
