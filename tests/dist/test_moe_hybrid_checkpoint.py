"""MoeHybridParallelPlugin: model checkpoints keep the experts in the Hugging Face layout and
reload at another ``ep_size``; bad sizes fail with clear errors.

A tiny Mixtral trains a few steps at ``ep_size=2`` (so every expert differs from its
initialisation), is saved with ``booster.save_model`` (sharded safetensors), then loaded by
``MixtralForCausalLM.from_pretrained`` and by freshly built models boosted at ``ep_size`` 1 and
4; all must hold exactly the trained weights and give the same loss.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from kolossos.booster import Booster
from kolossos.booster.plugin import MoeHybridParallelPlugin
from kolossos.interface import unwrap_model
from kolossos.moe import moe_info_of
from kolossos.testing import distributed
from kolossos.testing.parity import global_mean, shard

pytestmark = pytest.mark.dist

SEQ = 16


def build(seed: int, experts: int = 4) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.MixtralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        num_local_experts=experts, num_experts_per_tok=2, router_jitter_noise=0.0,
        bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(config)
    model.config._attn_implementation = "eager"
    return model


def batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(2, 128, (4, SEQ), generator=torch.Generator().manual_seed(7))
    return {"input_ids": ids, "labels": ids.clone()}


def full_params(module: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in module.named_parameters():
        info, value = moe_info_of(p), p.detach()
        if info is not None and info.ep_group is not None:
            parts = [torch.empty_like(value) for _ in range(info.ep_size)]
            dist.all_gather(parts, value.contiguous(), group=info.ep_group)
            value = torch.cat(parts)
        out[name] = value.clone()
    return out


def boosted(seed: int, **kwargs: Any) -> tuple[Booster, Any, Any, MoeHybridParallelPlugin]:
    model = build(seed)
    plugin = MoeHybridParallelPlugin(precision="fp32", **kwargs)
    booster = Booster(plugin=plugin)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    m, o, *_ = booster.boost(model, opt)
    return booster, m, o, plugin


def mean_loss(model: Any, plugin: MoeHybridParallelPlugin) -> float:
    data = {k: shard(v, plugin.mesh.dp_rank, plugin.mesh.dp_size) for k, v in batch().items()}
    with torch.no_grad():
        return global_mean(model(**data).loss)


def train_and_save(root: Path, **kwargs: Any) -> tuple[dict[str, torch.Tensor], float]:
    booster, model, opt, plugin = boosted(0, **kwargs)
    for _ in range(3):
        data = {k: shard(v, plugin.mesh.dp_rank, plugin.mesh.dp_size) for k, v in batch().items()}
        booster.backward(model(**data).loss, opt)
        opt.step()
        opt.zero_grad()
    booster.save_model(model, str(root), shard=True, use_safetensors=True, size_per_shard=0.05)
    if dist.get_rank() == 0:
        unwrap_model(model).config.save_pretrained(str(root))
    dist.barrier()
    return full_params(unwrap_model(model)), mean_loss(model, plugin)


def check_reload(root: Path, trained: dict[str, torch.Tensor], loss: float, ep: int) -> None:
    booster, model, _, plugin = boosted(123, ep_size=ep, zero_stage=1)
    booster.load_model(model, str(root))
    loaded = full_params(unwrap_model(model))
    assert loaded.keys() == trained.keys()
    for name, value in loaded.items():
        torch.testing.assert_close(value, trained[name], rtol=0, atol=0, msg=name)
    assert abs(mean_loss(model, plugin) - loss) < 1e-5


def check_from_pretrained(root: Path, trained: dict[str, torch.Tensor]) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.MixtralForCausalLM.from_pretrained(str(root))
    theirs = dict(hf.named_parameters())
    assert theirs["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 32)
    for name, value in trained.items():
        torch.testing.assert_close(theirs[name].detach(), value, rtol=0, atol=0, msg=name)


@distributed(2)
def test_ep2_checkpoint_hf_layout_and_ep1(tmp_path: Path) -> None:
    trained, loss = train_and_save(tmp_path / "ep2", ep_size=2)
    check_from_pretrained(tmp_path / "ep2", trained)
    check_reload(tmp_path / "ep2", trained, loss, ep=1)
    check_reload(tmp_path / "ep2", trained, loss, ep=2)

    # bad input, before any collective where possible
    with pytest.raises(ValueError, match=r"not divisible by ep_size \* pp_size \* tp_size"):
        MoeHybridParallelPlugin(ep_size=4, precision="fp32")
    with pytest.raises(NotImplementedError, match=r"tp_size=2 with ep_size=2"):
        MoeHybridParallelPlugin(tp_size=2, ep_size=2, precision="fp32")
    three = build(0, experts=3)
    plugin = MoeHybridParallelPlugin(ep_size=2, precision="fp32")
    with pytest.raises(ValueError, match=r"num_local_experts=3 is not divisible by ep_size=2"):
        Booster(plugin=plugin).boost(three, torch.optim.SGD(three.parameters(), lr=0.1))
    dense = copy.deepcopy(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"no expert-parallel plan for Linear"):
        Booster(plugin=plugin).boost(dense)


@distributed(4)
def test_ep2_dp2_checkpoint_reloads_at_ep4(tmp_path: Path) -> None:
    trained, loss = train_and_save(tmp_path / "ep2dp2", ep_size=2, zero_stage=1)
    check_reload(tmp_path / "ep2dp2", trained, loss, ep=4)
    check_reload(tmp_path / "ep2dp2", trained, loss, ep=1)
