"""HybridParallelPlugin(sp_size=..., sequence_parallelism_mode='all_to_all' | 'ring_attn') vs
single-process training on CPU/gloo.

Tiny transformers models (2 layers, hidden 32, 4 heads, sequence 16, dropout off), fp32: GPT-2
and LLaMA causal LMs with right padding, BERT masked LM with padding and ignored labels. Every
rank of a sequence-parallel group gets the same samples (its data-parallel share of the global
batch); the reference trains the whole model on the whole batch. Losses are compared at every
step, the gathered full parameters at the end, and every parameter must have moved by 10x the
tolerance.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from kolossos.booster import Booster
from kolossos.booster.plugin import HybridParallelPlugin
from kolossos.hybrid.sequence_parallel import SP_ATTENTION
from kolossos.interface import unwrap_model
from kolossos.nn.layer.parallel_1d import gather_tp_full, get_tp_spec
from kolossos.testing import distributed, parameterize
from kolossos.testing.parity import assert_moved, global_mean, shard, snapshot

pytestmark = pytest.mark.dist

STEPS = 6
GLOBAL_BATCH = 4
SEQ = 16
LR = 3e-2
# fp32: SP changes only the order of sums (the softmax over shards, the loss over shards, the
# gradient sums over the SP ranks) and the ring's online softmax; measured worst 3e-6.
TOL = 2e-5
# Attention key biases have an exactly zero gradient (softmax ignores a constant shift).
ZERO_GRADIENT = ("k_proj.bias", "attention.self.key.bias")


@pytest.fixture(scope="module")
def build() -> Callable[[str], nn.Module]:
    transformers = pytest.importorskip("transformers")
    configs: dict[str, Any] = {
        "gpt2": lambda: transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                vocab_size=100, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                bos_token_id=0, eos_token_id=0, attn_pdrop=0.0, resid_pdrop=0.0,
                embd_pdrop=0.0,
            )
        ),
        "llama": lambda: transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                bos_token_id=0, eos_token_id=0, pad_token_id=0,
            )
        ),
        "bert": lambda: transformers.BertForMaskedLM(
            transformers.BertConfig(
                vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=SEQ,
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            )
        ),
    }  # fmt: skip
    return lambda family: configs[family]()


def make_batch(
    family: str, pads: tuple[int, ...] = (0, 1, 2, 3), seed: int = 3
) -> dict[str, torch.Tensor]:
    """A global batch with right padding: sample i has its last ``pads[i]`` positions padded."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 100, (GLOBAL_BATCH, SEQ), generator=gen)
    mask = torch.ones(GLOBAL_BATCH, SEQ, dtype=torch.long)
    for i, pad in enumerate(pads):
        if pad:
            mask[i, -pad:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    if family == "bert":  # masked LM: predict about half the tokens
        labels = labels.masked_fill(torch.rand(labels.shape, generator=gen) < 0.5, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, eps=1e-3)


def full_params(module: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in module.named_parameters():
        spec = get_tp_spec(p)
        out[name] = gather_tp_full(p.detach(), spec) if spec is not None else p.detach()
    return out


def check(
    build: Callable[[str], nn.Module],
    family: str,
    mode: str,
    pads: tuple[int, ...] = (0, 1, 2, 3),
    **plugin_kwargs: Any,
) -> None:
    torch.manual_seed(0)
    model = build(family)
    ref = copy.deepcopy(model)
    initial = snapshot(model)
    ref_opt = adamw(ref)
    plugin = HybridParallelPlugin(
        enable_sequence_parallelism=True,
        sequence_parallelism_mode=mode,
        precision="fp32",
        **{"tp_size": 1, **plugin_kwargs},
    )
    booster = Booster(plugin=plugin)
    boosted, opt, _, _, _ = booster.boost(model, adamw(model))
    dp, dp_rank = plugin.mesh.dp_size, plugin.mesh.dp_rank
    inner = unwrap_model(boosted)
    assert inner.config._attn_implementation == SP_ATTENTION[mode]
    assert plugin.mesh.sp_size == plugin_kwargs["sp_size"]
    batch = make_batch(family, pads)
    losses, ref_losses = [], []
    for _ in range(STEPS):
        loss = boosted(**{k: shard(v, dp_rank, dp) for k, v in batch.items()}).loss
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        ref_loss = ref(**batch).loss
        ref_loss.backward()
        if plugin_kwargs.get("max_norm"):  # the plugin clips by the whole model's norm
            torch.nn.utils.clip_grad_norm_(ref.parameters(), plugin_kwargs["max_norm"])
        ref_opt.step()
        ref_opt.zero_grad()
        # every SP rank returns its group's loss (the whole sequences' mean)
        losses.append(global_mean(loss))
        ref_losses.append(ref_loss.item())
    torch.testing.assert_close(losses, ref_losses, rtol=TOL, atol=TOL)
    trained = full_params(unwrap_model(boosted))
    theirs = dict(ref.named_parameters())
    assert trained.keys() == theirs.keys()
    for name, value in trained.items():
        torch.testing.assert_close(value, theirs[name].detach(), rtol=TOL, atol=TOL, msg=name)
    still = [n for n in trained if n.endswith(ZERO_GRADIENT)]
    assert_moved(initial, trained, TOL, exclude=still)
    assert not math.isnan(losses[-1])


@distributed(2)
def test_sp2_matches_single_process(build: Callable[[str], nn.Module]) -> None:
    @parameterize("family", ["gpt2", "llama", "bert"])
    @parameterize("mode", ["all_to_all", "ring_attn"])
    def case(family: str, mode: str) -> None:
        check(build, family, mode, sp_size=2)

    case()


@distributed(4)
def test_sp2_tp2_matches_single_process(build: Callable[[str], nn.Module]) -> None:
    @parameterize("family", ["gpt2", "llama", "bert"])
    @parameterize("mode", ["all_to_all", "ring_attn"])
    def case(family: str, mode: str) -> None:
        check(build, family, mode, sp_size=2, tp_size=2)

    case()

    # Ulysses splits the heads left after TP: 2 heads / tp 2 = 1, not divisible by sp 2
    transformers = pytest.importorskip("transformers")
    two_heads = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=100, n_positions=SEQ, n_embd=32, n_layer=1, n_head=2)
    )
    plugin = HybridParallelPlugin(
        tp_size=2, sp_size=2, enable_sequence_parallelism=True,
        sequence_parallelism_mode="all_to_all", precision="fp32",
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"leaves 1 heads per tensor-parallel rank.*'ring_attn'"):
        Booster(plugin=plugin).boost(two_heads, adamw(two_heads))


@distributed(4)
def test_sp2_dp2_zero_matches_single_process(build: Callable[[str], nn.Module]) -> None:
    @parameterize("family", ["gpt2", "llama"])
    @parameterize("mode", ["all_to_all", "ring_attn"])
    @parameterize("zero_stage", [0, 2])
    def case(family: str, mode: str, zero_stage: int) -> None:
        # data parallelism averages the ranks' means: equal target counts per data-parallel
        # share make that the whole batch's mean (as in single-process training)
        pads = (0, 2, 2, 0)
        check(build, family, mode, pads, sp_size=2, zero_stage=zero_stage, max_norm=1.0)

    case()

    # the SP ranks of one group see the same samples, the data-parallel ranks different ones
    plugin = HybridParallelPlugin(
        tp_size=1, sp_size=2, enable_sequence_parallelism=True,
        sequence_parallelism_mode="all_to_all", precision="fp32",
    )  # fmt: skip
    loader = plugin.prepare_dataloader(list(range(8)), batch_size=2, shuffle=True, seed=1)
    seen = torch.tensor(next(iter(loader)))
    everyone = [torch.zeros_like(seen) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, seen)
    sp_peer = dist.get_rank() ^ 1  # (dp, pp, tp, sp) mesh: the SP ranks are consecutive
    assert torch.equal(everyone[sp_peer], seen)
    assert not torch.equal(everyone[dist.get_rank() ^ 2], seen)


def check_pipeline(
    build: Callable[[str], nn.Module], family: str, mode: str, **plugin_kwargs: Any
) -> None:
    """pp 2 x sp 2 through ``execute_pipeline`` (one block per stage, two micro-batches): the
    reference trains on the mean of the micro-batches' losses, as the schedule does."""
    micro = 2
    torch.manual_seed(0)
    model = build(family)
    ref = copy.deepcopy(model)
    initial = snapshot(model.named_parameters(remove_duplicate=False))
    ref_opt = adamw(ref)
    plugin = HybridParallelPlugin(
        tp_size=1, pp_size=2, sp_size=2, num_microbatches=micro, precision="fp32",
        enable_sequence_parallelism=True, sequence_parallelism_mode=mode, **plugin_kwargs,
    )  # fmt: skip
    booster = Booster(plugin=plugin)
    boosted, opt, _, _, _ = booster.boost(model, adamw(model))
    assert plugin.mesh.sp_size == 2 and plugin.mesh.dp_size == 1
    sm = plugin.stage_manager
    last = sm.is_last_stage(0)
    batch = make_batch(family)
    shapes: list[tuple[int, ...]] = []

    # the hidden state the last stage receives is the (micro-batch, S / sp, H) shard
    def received(module: nn.Module, args: Any, kwargs: Any) -> None:
        shapes.append(tuple((args[0] if args else kwargs["hidden_states"]).shape))

    if last:
        block = boosted.chunks[0].get_submodule(SECOND_BLOCK[family])
        block.register_forward_pre_hook(received, with_kwargs=True)
    losses, ref_losses = [], []
    for _ in range(STEPS):
        out = booster.execute_pipeline(iter([batch]), boosted, lambda o, _: o.loss, opt,
                                       return_outputs=True)  # fmt: skip
        assert (out["loss"] is not None) == last
        if last:  # the micro-batches' logits of the sequence shard
            assert out["outputs"]["logits"].shape[:2] == (GLOBAL_BATCH, SEQ // 2)
        opt.step()
        opt.zero_grad()
        value = torch.tensor([out["loss"].item() if last else 0.0], dtype=torch.float64)
        dist.all_reduce(value)  # the two SP ranks of the last stage hold the same loss
        losses.append(value.item() / 2)
        ref_loss = sum(ref(**{k: shard(v, i, micro) for k, v in batch.items()}).loss
                       for i in range(micro)) / micro  # fmt: skip
        ref_loss.backward()
        if plugin_kwargs.get("max_norm"):  # the plugin clips by the whole model's norm
            torch.nn.utils.clip_grad_norm_(ref.parameters(), plugin_kwargs["max_norm"])
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    torch.testing.assert_close(losses, ref_losses, rtol=TOL, atol=TOL)
    if last:
        assert len(shapes) == STEPS * micro, shapes
        assert set(shapes) == {(GLOBAL_BATCH // micro, SEQ // 2, 32)}, shapes
    # the parameters of both stages, gathered on every rank, equal the reference's
    mine = {n: p.detach().clone() for c in boosted.chunks for n, p in c.named_parameters()}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    trained: dict[str, torch.Tensor] = {}
    for part in everyone:
        trained.update(part)
    theirs = dict(ref.named_parameters(remove_duplicate=False))  # tied copies on two stages
    assert set(trained) <= theirs.keys()  # and every reference parameter (aliases once):
    assert {id(theirs[n]) for n in trained} == {id(p) for p in theirs.values()}
    for name, value in trained.items():
        torch.testing.assert_close(value, theirs[name].detach(), rtol=TOL, atol=TOL, msg=name)
    still = [n for n in trained if n.endswith(ZERO_GRADIENT)]
    assert_moved(initial, trained, TOL, exclude=still)


SECOND_BLOCK = {
    "gpt2": "transformer.h.1", "llama": "model.layers.1", "bert": "bert.encoder.layer.1"
}  # fmt: skip


@distributed(4)
def test_pp2_sp2_matches_single_process(build: Callable[[str], nn.Module]) -> None:
    @parameterize("family", ["gpt2", "llama", "bert"])
    @parameterize("mode", ["all_to_all", "ring_attn"])
    def case(family: str, mode: str) -> None:
        check_pipeline(build, family, mode)

    case()

    # ZeRO-1 over dp x sp (here the two SP ranks) with clipping, the tied wte / lm_head
    @parameterize("mode", ["all_to_all", "ring_attn"])
    def zero(mode: str) -> None:
        check_pipeline(build, "gpt2", mode, zero_stage=1, max_norm=1.0)

    zero()
