"""HybridParallelPlugin with ``sequence_parallelism_mode='ring'`` and with
``enable_sequence_overlap=True`` vs single-process training on CPU/gloo.

Tiny transformers models (2 layers, hidden 32, 4 heads, sequence 16, dropout off), fp32: GPT-2
and LLaMA causal LMs, a BERT token classifier (a loss at every position, so that the last
layer's query bias moves too). The reference trains the unsharded model in one process
on the global batch; the plugin trains the TP-sharded model (each data-parallel rank on its
share). Losses are compared at every step, the gathered full parameters at the end, and every
parameter must have moved by 10x the tolerance. Overlap on and off must give the same numbers
bit for bit (only the schedule of the collectives differs).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from kolossos.booster import Booster
from kolossos.booster.plugin import HybridParallelPlugin
from kolossos.interface import unwrap_model
from kolossos.nn.layer.parallel_1d import Linear1D_Row, gather_tp_full, get_tp_spec
from kolossos.shardformer import GradientCheckpointConfig
from kolossos.shardformer.fused_region import StagedFusedLinear1D_Col, StagedLinear1D_Col
from kolossos.testing import distributed, parameterize
from kolossos.testing.parity import assert_moved, global_mean, shard, snapshot
from kolossos.utils.profiling import CommCounter

pytestmark = pytest.mark.dist

STEPS = 6
GLOBAL_BATCH = 4
SEQ = 16
LR = 3e-2
# fp32: the ring changes only the order of sums (the ranks' partial products added in ring order,
# matmuls per sequence chunk), like split_gather's collectives; measured worst 2.2e-6 (LLaMA).
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
        "bert": lambda: transformers.BertForTokenClassification(
            transformers.BertConfig(
                vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=SEQ, num_labels=3,
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            )
        ),
    }  # fmt: skip
    return lambda family: configs[family]()


def make_batch(family: str) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(2, 100, (GLOBAL_BATCH, SEQ), generator=gen)
    if family == "bert":
        labels = torch.randint(0, 3, (GLOBAL_BATCH, SEQ), generator=gen)  # every position
        return {"input_ids": ids, "labels": labels}
    return {"input_ids": ids, "labels": ids}


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    # eps 1e-3: small gradients still move their parameters by 10x the tolerance
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1, eps=1e-3)


def full_params(module: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in module.named_parameters():
        spec = get_tp_spec(p)
        out[name] = gather_tp_full(p.detach(), spec) if spec is not None else p.detach()
    return out


def train(
    model: nn.Module, family: str, tp: int, **plugin_kwargs: Any
) -> tuple[list[float], dict[str, torch.Tensor], nn.Module]:
    """The plugin's losses (global mean) at each step, its gathered parameters, the module."""
    world = dist.get_world_size()
    dp, dp_rank = world // tp, dist.get_rank() // tp  # TP ranks consecutive
    plugin = HybridParallelPlugin(
        tp_size=tp, precision="fp32", enable_sequence_parallelism=True, **plugin_kwargs
    )
    booster = Booster(plugin=plugin)
    boosted, opt, _, _, _ = booster.boost(model, adamw(model))
    batch = {k: shard(v, dp_rank, dp) for k, v in make_batch(family).items()}
    losses = []
    for _ in range(STEPS):
        loss = boosted(**batch).loss
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        losses.append(global_mean(loss))
    module = unwrap_model(boosted)
    return losses, full_params(module), module


def reference(model: nn.Module, family: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = copy.deepcopy(model)
    opt = adamw(model)
    batch, losses = make_batch(family), []
    for _ in range(STEPS):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def check_parity(
    build: Callable[[str], nn.Module], family: str, tp: int = 2, **kwargs: Any
) -> nn.Module:
    torch.manual_seed(0)
    model = build(family)
    initial = snapshot(model)
    ref_losses, ref_params = reference(model, family)
    losses, params, module = train(model, family, tp, **kwargs)
    torch.testing.assert_close(losses, ref_losses, rtol=TOL, atol=TOL)
    assert params.keys() == ref_params.keys()
    for name, value in params.items():
        torch.testing.assert_close(value, ref_params[name], rtol=TOL, atol=TOL, msg=name)
    still = [n for n in params if n.endswith(ZERO_GRADIENT)]
    assert_moved(initial, params, TOL, exclude=still)
    return module


def assert_ring_layers(module: nn.Module) -> None:
    """Every column layer is staged (its region's entry runs the ring) and every row layer of
    the blocks reduce-scatters around the ring."""
    staged = (StagedLinear1D_Col, StagedFusedLinear1D_Col)
    cols = [m for m in module.modules() if isinstance(m, staged)]
    rows = [m for m in module.modules() if isinstance(m, Linear1D_Row)]
    assert cols and rows and all(r.seq_parallel_mode == "ring" for r in rows)


@distributed(2)
def test_ring_tp2_matches_single_process(build: Callable[[str], nn.Module]) -> None:
    @parameterize("family", ["gpt2", "llama", "bert"])
    def case(family: str) -> None:
        module = check_parity(build, family, sequence_parallelism_mode="ring")
        assert_ring_layers(module)
        batch = make_batch(family)
        with CommCounter() as comm:
            module(**batch).loss.backward()
        # ring exchanges are point-to-point; the collectives left are the sequence split/gather
        # at the model's ends, the vocabulary layers and the loss
        assert comm.calls("send") > 0 and comm.calls("send") == comm.calls("recv")

    case()


@distributed(4)
def test_ring_tp2_dp2_zero_and_tp4_match_single_process(build: Callable[[str], nn.Module]) -> None:
    @parameterize("family", ["gpt2", "llama"])
    @parameterize("zero_stage", [1, 2])
    def case(family: str, zero_stage: int) -> None:
        check_parity(build, family, sequence_parallelism_mode="ring", zero_stage=zero_stage)

    case()
    check_parity(build, "bert", sequence_parallelism_mode="ring", zero_stage=1)

    @parameterize("family", ["gpt2", "bert"])  # LLaMA's 2 KV heads do not split over 4
    def four_rank_ring(family: str) -> None:
        check_parity(build, family, tp=4, sequence_parallelism_mode="ring")

    four_rank_ring()


@distributed(2)
def test_sequence_overlap_on_off_identical(build: Callable[[str], nn.Module]) -> None:
    @parameterize("family", ["gpt2", "llama", "bert"])
    def case(family: str) -> None:
        torch.manual_seed(0)
        model = build(family)
        off = train(copy.deepcopy(model), family, 2)
        on = check_parity(build, family, enable_sequence_overlap=True)
        on_losses, on_params, _ = train(
            copy.deepcopy(model), family, 2, enable_sequence_overlap=True
        )
        assert on_losses == off[0]
        for name, value in on_params.items():
            assert torch.equal(value, off[1][name]), name
        assert any(
            isinstance(m, StagedLinear1D_Col | StagedFusedLinear1D_Col) for m in on.modules()
        )

    case()


MICRO = 2


def train_pipelined(
    model: nn.Module, family: str, **plugin_kwargs: Any
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """pp 2 x tp 2: the last stage's loss (shared with every rank) at each step, and every
    stage's parameters gathered over TP, on every rank."""
    plugin = HybridParallelPlugin(
        tp_size=2, pp_size=2, num_microbatches=MICRO, precision="fp32",
        enable_sequence_parallelism=True, **plugin_kwargs,
    )  # fmt: skip
    booster = Booster(plugin=plugin)
    boosted, opt, *_ = booster.boost(model, adamw(model))
    losses = []
    for _ in range(STEPS):
        out = booster.execute_pipeline(
            iter([make_batch(family)]), boosted, lambda o, _: o.loss, opt
        )
        opt.step()
        opt.zero_grad()
        held = out["loss"] is not None
        value = torch.tensor([out["loss"].item() if held else 0.0, float(held)])
        dist.all_reduce(value)  # every last-stage rank holds the same loss
        losses.append((value[0] / value[1]).item())
    mine = {}
    for chunk in boosted.chunks:
        for name, p in chunk.named_parameters():
            spec = get_tp_spec(p)
            mine[name] = gather_tp_full(p.detach(), spec) if spec is not None else p.detach()
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return losses, {n: v for part in everyone for n, v in part.items()}


@distributed(4)
def test_ring_and_overlap_with_pipeline_stages(build: Callable[[str], nn.Module]) -> None:
    """pp 2 x tp 2: the stages exchange sequence shards (as split_gather does); inside each
    stage the regions run the ring or the overlapped entry. Reference: the mean of the
    micro-batch losses, one process."""

    @parameterize("family", ["gpt2", "llama"])
    @parameterize(
        "extra", [{"sequence_parallelism_mode": "ring"}, {"enable_sequence_overlap": True}]
    )
    def case(family: str, extra: dict[str, Any]) -> None:
        torch.manual_seed(0)
        model = build(family)
        ref = copy.deepcopy(model)
        initial = snapshot(model.named_parameters(remove_duplicate=False))
        losses, params = train_pipelined(model, family, **extra)
        opt, ref_losses = adamw(ref), []
        batch = make_batch(family)
        for _ in range(STEPS):
            pieces = [ref(**{k: shard(v, i, MICRO) for k, v in batch.items()}).loss
                      for i in range(MICRO)]  # fmt: skip
            loss = sum(pieces) / MICRO
            loss.backward()
            opt.step()
            opt.zero_grad()
            ref_losses.append(loss.item())
        torch.testing.assert_close(losses, ref_losses, rtol=TOL, atol=TOL)
        theirs = dict(ref.named_parameters(remove_duplicate=False))
        assert params.keys() == theirs.keys()
        for name, value in params.items():
            torch.testing.assert_close(value, theirs[name].detach(), rtol=TOL, atol=TOL, msg=name)
        still = [n for n in params if n.endswith(ZERO_GRADIENT)]
        assert_moved(initial, params, TOL, exclude=still)

    case()


@distributed(2)
def test_ring_and_overlap_under_gradient_checkpointing(build: Callable[[str], nn.Module]) -> None:
    """Every block recomputed in backward: the region entries run again inside the recomputation
    (their exchanges included) and the staged outputs are taken by the recomputed layers."""
    ckpt = GradientCheckpointConfig(gradient_checkpointing_ratio=1.0)

    @parameterize("family", ["gpt2", "llama", "bert"])
    @parameterize(
        "extra", [{"sequence_parallelism_mode": "ring"}, {"enable_sequence_overlap": True}]
    )
    def case(family: str, extra: dict[str, Any]) -> None:
        module = check_parity(build, family, gradient_checkpoint_config=ckpt, **extra)
        staged = [m for m in module.modules() if isinstance(m, StagedLinear1D_Col)]
        calls: list[nn.Module] = []
        for layer in staged:
            layer.register_forward_pre_hook(lambda mod, args: calls.append(mod))
        module(**make_batch(family)).loss.backward()
        assert staged and len(calls) == 2 * len(staged)  # forward, again in the recomputation

    case()
