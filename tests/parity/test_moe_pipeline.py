"""MoeHybridParallelPlugin with pipeline stages (pp=2 x ep=2, 4 ranks) vs single-process HF Mixtral.

Tiny Mixtral (2 layers: one per stage, hidden 32, 4 experts, top-2, sequence 16), fp32, AdamW.
The mesh is (dp, pp, tp) = (2, 2, 1): each stage's two data-parallel ranks form its
expert-parallel group (2 experts each), so the expert DP group is one rank. Every step runs
``booster.execute_pipeline`` (1F1B, 2 micro-batches) on the rank's data-parallel share; the
reference trains the unmodified model in one process on the global batch. Losses every step,
every parameter at the end (experts gathered over their EP group), every parameter moved 10x
the tolerance. ``max_norm`` small enough to clip at every step checks the global norm over
dense parameters, stages and expert shards (each expert counted once).
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
from kolossos.moe import moe_info_of
from kolossos.testing import distributed, parameterize
from kolossos.testing.parity import assert_moved, shard, snapshot

pytestmark = pytest.mark.dist

STEPS = 4
GLOBAL_BATCH = 4
SEQ = 16
LR = 1e-2
# fp32: pipelining and expert parallelism change only where rows are computed and the order of
# the gradient sums.
TOL = 2e-5


def build(**overrides: Any) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        num_experts_per_tok=2, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        num_local_experts=4, router_jitter_noise=0.0, **overrides,
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(config)
    model.config._attn_implementation = "eager"
    return model


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, eps=1e-3)


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    """For clipping: an update proportional to the gradient, so a wrong clip factor shows
    (Adam is nearly invariant to it)."""
    return torch.optim.SGD(model.parameters(), lr=5.0, momentum=0.9)


def lm_loss(outputs: Any, inputs: Any) -> torch.Tensor:
    return outputs.loss


def stage_params(boosted: Any) -> dict[str, torch.Tensor]:
    """This rank's stage parameters at full size (experts gathered over their EP group)."""
    out = {}
    for chunk in boosted.chunks:
        for name, p in chunk.named_parameters():
            value, info = p.detach(), moe_info_of(p)
            if info is not None and info.ep_group is not None:
                parts = [torch.empty_like(value) for _ in range(info.ep_size)]
                dist.all_gather(parts, value.contiguous(), group=info.ep_group)
                value = torch.cat(parts)
            out[name] = value
    return out


def check(max_norm: float = 0.0, zero_stage: int = 0) -> list[float]:
    """Train 4 steps at pp 2 x ep 2; returns the reference's pre-clip gradient norms."""
    torch.manual_seed(0)
    model = build()
    ref = copy.deepcopy(model)
    initial = snapshot(model)
    make_opt = sgd if max_norm > 0 else adamw
    ref_opt = make_opt(ref)
    plugin = MoeHybridParallelPlugin(
        pp_size=2, ep_size=2, num_microbatches=2, precision="fp32", max_norm=max_norm,
        zero_stage=zero_stage,
    )  # fmt: skip
    booster = Booster(plugin=plugin)
    boosted, opt, *_ = booster.boost(model, make_opt(model))
    assert plugin.moe_info.ep_size == 2 and plugin.moe_info.dp_size == 1
    dp, dp_rank = plugin.mesh.dp_size, plugin.mesh.dp_rank
    ids = torch.randint(2, 128, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": ids, "labels": ids}
    losses, ref_losses, norms = [], [], []
    for _ in range(STEPS):
        mine = {k: shard(v, dp_rank, dp) for k, v in batch.items()}
        out = booster.execute_pipeline(iter([mine]), boosted, lm_loss, opt)
        opt.step()
        opt.zero_grad()
        total = torch.tensor([0.0 if out["loss"] is None else out["loss"].item()])
        dist.all_reduce(total)  # the last stage's dp ranks hold a loss each
        losses.append(total.item() / dp)
        ref_loss = ref(**batch).loss
        ref_loss.backward()
        if max_norm > 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)))
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    torch.testing.assert_close(losses, ref_losses, rtol=TOL, atol=TOL)
    trained = stage_params(boosted)
    theirs = dict(ref.named_parameters())
    for name, value in trained.items():
        torch.testing.assert_close(value, theirs[name].detach(), rtol=TOL, atol=TOL, msg=name)
    assert any(".experts." in n for n in trained) and len(trained) < len(theirs)
    assert_moved({n: initial[n] for n in trained}, trained, TOL)
    return norms


MAX_NORM = 0.1  # below every step's norm: clipping acts at every step


@distributed(4)
def test_pp2_ep2_matches_single_process(tmp_path: Path) -> None:
    @parameterize("zero_stage", [0, 1, 2])
    def case(zero_stage: int) -> None:
        check(zero_stage=zero_stage)
        norms = check(max_norm=MAX_NORM, zero_stage=zero_stage)
        assert min(norms) > 2 * MAX_NORM, norms

    case()
    model = build(output_router_logits=True)
    plugin = MoeHybridParallelPlugin(pp_size=2, ep_size=2, num_microbatches=2, precision="fp32")
    with pytest.raises(NotImplementedError, match="output_router_logits"):
        Booster(plugin=plugin).boost(model, adamw(model))
    model = build()
    booster = Booster(plugin=plugin)
    boosted, opt, *_ = booster.boost(model, adamw(model))
    with pytest.raises(NotImplementedError, match="pp_size > 1 are not implemented"):
        booster.save_model(boosted, tmp_path / "model", shard=True)
    with pytest.raises(NotImplementedError, match="pp_size > 1 are not implemented"):
        booster.save_optimizer(opt, tmp_path / "optim", shard=True)
    # execute_pipeline refuses objects boost did not return, naming this plugin
    ids = torch.randint(2, 128, (2, SEQ))
    step = iter([{"input_ids": ids, "labels": ids}])
    with pytest.raises(TypeError, match=r"MoeHybridParallelPlugin\(pp_size > 1\)"):
        booster.execute_pipeline(step, model, lm_loss, opt)
    with pytest.raises(TypeError, match=r"optimizer returned by booster\.boost, got AdamW"):
        booster.execute_pipeline(step, boosted, lm_loss, adamw(build()))
    transformers = pytest.importorskip("transformers")
    qwen = transformers.Qwen2MoeForCausalLM(
        transformers.Qwen2MoeConfig(
            vocab_size=128, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=16,
            shared_expert_intermediate_size=32,
        )
    )  # fmt: skip
    with pytest.raises(NotImplementedError, match="no pipeline stage layout"):
        Booster(plugin=plugin).boost(qwen, adamw(qwen))
