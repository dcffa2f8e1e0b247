"""Lazy initialisation under every plugin equals eager initialisation, bit for bit.

For each plugin the same model is built twice under the same seed — eagerly, and inside
``LazyInitContext`` — boosted, trained two steps on the same data, and saved through the plugin's
checkpoint IO. Each plugin materialises a lazy model its own way (whole for DDP and LowLevelZero,
chunk shards for Gemini, FSDP2 shards, this stage's tensor-parallel slices for the hybrid engine),
so equality of the losses (exact) and of every saved tensor (``torch.equal``) shows that the
shards each rank computed are the shards of the eager model. A third, differently seeded eager
build checks that the comparison can fail, and the trained weights must differ from the initial
ones (the steps did something).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from kolossos.booster import Booster
from kolossos.booster.plugin import (
    GeminiPlugin,
    HybridParallelPlugin,
    LowLevelZeroPlugin,
    TorchDDPPlugin,
    TorchFSDPPlugin,
)
from kolossos.lazy import LazyInitContext, is_lazy_module
from kolossos.models import vit_tiny
from kolossos.models.resnet import BasicBlock, ResNet
from kolossos.testing import distributed

SEQ, BATCH, VOCAB = 8, 4, 64
Build = Callable[[], nn.Module]


def _models() -> dict[str, Build]:
    transformers = pytest.importorskip("transformers")
    gpt2 = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    llama = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    bert = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    vit = transformers.ViTConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        image_size=16, patch_size=8, num_labels=10, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return {
        "gpt2": lambda: transformers.GPT2LMHeadModel(gpt2),
        "llama": lambda: transformers.LlamaForCausalLM(llama),
        "bert": lambda: transformers.BertForMaskedLM(bert),
        "vit": lambda: transformers.ViTForImageClassification(vit),
        "kolossos_vit": lambda: vit_tiny(10, image_size=16, patch_size=8),
        "kolossos_resnet": lambda: ResNet(
            BasicBlock, (1, 1, 1, 1), num_classes=10, cifar_stem=True, base_width=8
        ),
    }


def _batch(model_name: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    if model_name in ("vit", "kolossos_vit", "kolossos_resnet"):
        images = torch.randn(BATCH, 3, 16, 16, generator=gen)
        labels = torch.randint(0, 10, (BATCH,), generator=gen)
        key = "pixel_values" if model_name == "vit" else "x"
        return {key: images, "labels": labels}
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen)
    return {"input_ids": ids, "labels": ids}


PLUGINS: dict[str, Callable[[], Any]] = {
    "ddp": lambda: TorchDDPPlugin(),
    "zero1": lambda: LowLevelZeroPlugin(stage=1, precision="fp32"),
    "zero2": lambda: LowLevelZeroPlugin(stage=2, precision="bf16"),
    "gemini": lambda: GeminiPlugin(
        precision="bf16", hidden_dim=32, min_chunk_size_m=2048 / 2**20, search_range_m=0.002
    ),
    "fsdp": lambda: TorchFSDPPlugin(),
    "tp2": lambda: HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32"),
    "pp2": lambda: HybridParallelPlugin(tp_size=1, pp_size=2, num_microbatches=2),
    "tp2pp2": lambda: HybridParallelPlugin(tp_size=2, pp_size=2, num_microbatches=2),
    "gemini_offload": lambda: GeminiPlugin(
        precision="bf16",
        placement_policy="static",
        shard_param_frac=0.5,
        offload_optim_frac=1.0,
        hidden_dim=32,
        min_chunk_size_m=2048 / 2**20,
        search_range_m=0.002,
    ),
}


def _loss(outputs: Any, inputs: Any) -> torch.Tensor:
    return outputs.loss


def _forward(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    if "x" in batch:  # a kolossos model: logits
        return F.cross_entropy(model(batch["x"]), batch["labels"])
    return model(**batch).loss


def _train(
    plugin: Any, model: nn.Module, batch: dict[str, torch.Tensor], path: Path
) -> tuple[list[float], dict[str, Any]]:
    """Boost, train 2 steps, save; return the losses and the saved tensors."""
    optimizer: Any = torch.optim.AdamW(model.parameters(), lr=1e-2)
    booster = Booster(plugin=plugin)
    model, optimizer, *_ = booster.boost(model, optimizer)
    assert not is_lazy_module(model), "boost left lazy tensors behind"
    losses = []
    for _ in range(2):
        if plugin.support_pipeline() and plugin.pp_size > 1:
            out = booster.execute_pipeline(iter([batch]), model, _loss, optimizer)
            loss = out["loss"] if out["loss"] is not None else torch.zeros(())
        else:
            loss = _forward(model, batch)
            booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        value = loss.detach().float().reshape(1)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        losses.append(value.item())
    booster.save_model(model, str(path), shard=True, use_safetensors=True)
    dist.barrier()
    from safetensors.torch import load_file

    state: dict[str, Any] = {}
    for file in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(file)))
    return losses, state


def _build(build: Build, seed: int, lazy: bool) -> nn.Module:
    torch.manual_seed(seed)
    if not lazy:
        return build()
    with LazyInitContext():
        model = build()
    assert is_lazy_module(model)
    return model


def _compare(plugin_name: str, model_name: str, tmp: Path) -> None:
    build = _models()[model_name]
    runs: dict[str, tuple[list[float], dict[str, Any]]] = {}
    for label, seed, lazy in (("eager", 0, False), ("lazy", 0, True), ("other", 1, False)):
        model = _build(build, seed, lazy)
        initial = {n: t.detach().clone() for n, t in model.state_dict().items()} if not lazy else {}
        path = tmp / f"{plugin_name}-{model_name}-{label}"
        runs[label] = _train(PLUGINS[plugin_name](), model, _batch(model_name), path)
        if label == "eager":
            moved = [
                n
                for n, t in runs[label][1].items()
                if n in initial
                and t.dtype.is_floating_point
                and not torch.equal(t, initial[n].to(t.dtype))
            ]
            assert moved, "training did not change the weights"
    (eager_losses, eager_state), (lazy_losses, lazy_state) = runs["eager"], runs["lazy"]
    other_state = runs["other"][1]
    where = f"{plugin_name} / {model_name}"
    assert eager_losses == lazy_losses, (where, eager_losses, lazy_losses)
    assert eager_state.keys() == lazy_state.keys(), where
    different = [k for k in eager_state if not torch.equal(eager_state[k], lazy_state[k])]
    assert not different, (where, different[:5])
    assert any(not torch.equal(eager_state[k], other_state[k]) for k in eager_state), where


ALL = ("ddp", "zero1", "zero2", "gemini", "gemini_offload", "fsdp", "tp2", "pp2")
DATA_PARALLEL = ("ddp", "zero2", "gemini", "fsdp")  # models without a tensor-parallel plan


@distributed(2)
@pytest.mark.parametrize(
    ("model_name", "plugins"),
    [
        ("gpt2", ALL),
        ("llama", ALL),
        ("bert", ALL),
        ("vit", ALL),
        ("kolossos_vit", DATA_PARALLEL),
        ("kolossos_resnet", DATA_PARALLEL),
    ],
)
def test_lazy_equals_eager_on_2_ranks(
    model_name: str, plugins: tuple[str, ...], tmp_path: Path
) -> None:
    for plugin_name in plugins:
        _compare(plugin_name, model_name, tmp_path)


@distributed(4)
def test_lazy_equals_eager_on_4_ranks(tmp_path: Path) -> None:
    for plugin_name in ("ddp", "zero1", "zero2", "gemini", "fsdp", "tp2", "pp2", "tp2pp2"):
        _compare(plugin_name, "gpt2", tmp_path)
