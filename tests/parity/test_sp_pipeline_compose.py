"""Sequence parallelism composed with pipeline parallelism in HybridParallelPlugin vs single-
process training (CPU/gloo, fp32, 4 ranks at most).

* ``'split_gather'`` (Megatron SP over the TP group) with pp 2 x tp 2: the stages exchange the
  ``(micro-batch, S / tp, H)`` shard; GPT-2, LLaMA, BERT; GPT-2 also interleaved and zero-
  bubble V, LLaMA with gradient checkpointing;
* ``'all_to_all'`` / ``'ring_attn'`` with pp 2 x sp 2 (dp 1: the SP ranks are carved out of
  data parallelism, so ZeRO partitions over the ``dp x sp`` = 2 SP ranks) under ZeRO-1 and
  ZeRO-2, the interleaved (2 chunks) and zero-bubble V schedules, and gradient checkpointing
  (every block recomputed, micro-batches with different padding).

Tiny transformers models (hidden 32, 4 heads, sequence 16, dropout off). The reference trains
the whole model on the mean of the micro-batches' losses, as the schedule does. Losses are
compared at every step, the gathered full parameters of every stage at the end, and every
parameter must have moved by 10x the tolerance.
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
from kolossos.nn.layer.parallel_1d import gather_tp_full, get_tp_spec
from kolossos.shardformer import GradientCheckpointConfig
from kolossos.shardformer.pipeline import stage_of
from kolossos.testing import distributed, parameterize
from kolossos.testing.parity import assert_moved, shard, snapshot

pytestmark = pytest.mark.dist

STEPS = 5
GLOBAL_BATCH = 4
MICRO = 2
SEQ = 16
HIDDEN = 32
LR = 3e-2
# fp32: SP and TP change only the order of sums (softmax and loss over shards, gradient sums
# over the TP / SP ranks and the micro-batches); the tied embeddings summed over the stages
# add one more. Measured worst: 3e-6 (loss and parameters).
TOL = 2e-5
# Attention key biases have an exactly zero gradient (softmax ignores a constant shift).
ZERO_GRADIENT = ("k_proj.bias", "attention.self.key.bias")
BLOCKS = {"gpt2": "transformer.h", "llama": "model.layers", "bert": "bert.encoder.layer"}
ATTENTION = {"gpt2": "attn", "llama": "self_attn", "bert": "attention.self"}


@pytest.fixture(scope="module")
def build() -> Callable[..., nn.Module]:
    transformers = pytest.importorskip("transformers")

    def make(family: str, layers: int = 2, tied: bool = True) -> nn.Module:
        if family == "gpt2":
            return transformers.GPT2LMHeadModel(
                transformers.GPT2Config(
                    vocab_size=100, n_positions=SEQ, n_embd=HIDDEN, n_layer=layers, n_head=4,
                    bos_token_id=0, eos_token_id=0, attn_pdrop=0.0, resid_pdrop=0.0,
                    embd_pdrop=0.0, tie_word_embeddings=tied,
                )
            )  # fmt: skip
        if family == "llama":
            return transformers.LlamaForCausalLM(
                transformers.LlamaConfig(
                    vocab_size=128, hidden_size=HIDDEN, intermediate_size=64,
                    num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                )
            )  # fmt: skip
        return transformers.BertForMaskedLM(
            transformers.BertConfig(
                vocab_size=128, hidden_size=HIDDEN, intermediate_size=64,
                num_hidden_layers=layers, num_attention_heads=4, max_position_embeddings=SEQ,
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            )
        )  # fmt: skip

    return make


def make_batch(family: str, pads: tuple[int, ...] = (0, 1, 2, 3)) -> dict[str, torch.Tensor]:
    """Right padding: sample i has its last ``pads[i]`` positions padded, so the two micro-
    batches carry different padding masks."""
    gen = torch.Generator().manual_seed(3)
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


class Pipelined:
    """A boosted pipeline model and optimizer; records the hidden state every non-first stage
    receives and the attention calls of this rank's blocks."""

    def __init__(self, model: nn.Module, family: str, **plugin_kwargs: Any) -> None:
        self.plugin = HybridParallelPlugin(
            pp_size=2, num_microbatches=MICRO, precision="fp32", enable_sequence_parallelism=True,
            **{"tp_size": 1, **plugin_kwargs},
        )  # fmt: skip
        self.booster = Booster(plugin=self.plugin)
        self.model, self.opt, *_ = self.booster.boost(model, adamw(model))
        self.received: list[tuple[int, ...]] = []
        self.attention_calls = 0
        self.later_chunks = 0
        for chunk in self.model.chunks:
            stage = stage_of(chunk)
            assert stage is not None
            blocks = chunk.get_submodule(BLOCKS[family])
            if not stage.first:  # runs after the engine's hooks: sees what the block gets
                blocks[0].register_forward_pre_hook(self._record, with_kwargs=True)
                self.later_chunks += 1
            for block in blocks:
                block.get_submodule(ATTENTION[family]).register_forward_pre_hook(self._count)

    def _record(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        self.received.append(tuple((args[0] if args else kwargs["hidden_states"]).shape))

    def _count(self, module: nn.Module, args: Any) -> None:
        self.attention_calls += 1

    def step(self, batch: dict[str, torch.Tensor]) -> float:
        """One update; the loss of the last stage, shared with every rank."""
        out = self.booster.execute_pipeline(iter([batch]), self.model, lambda o, _: o.loss,
                                            self.opt)  # fmt: skip
        self.opt.step()
        self.opt.zero_grad()
        held = out["loss"] is not None
        value = torch.tensor(
            [out["loss"].item() if held else 0.0, float(held)], dtype=torch.float64
        )
        dist.all_reduce(value)  # every last-stage rank holds the same loss
        return (value[0] / value[1]).item()

    def full_params(self) -> dict[str, torch.Tensor]:
        """Every stage's parameters, gathered over TP, on every rank."""
        mine = {}
        for chunk in self.model.chunks:
            for name, p in chunk.named_parameters():
                spec = get_tp_spec(p)
                mine[name] = gather_tp_full(p.detach(), spec) if spec is not None else p.detach()
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return {n: v for part in everyone for n, v in part.items()}


def check(
    build: Callable[..., nn.Module],
    family: str,
    *,
    layers: int = 2,
    tied: bool = True,
    received: tuple[int, ...] | None = None,
    **plugin_kwargs: Any,
) -> Pipelined:
    """Train pipelined and single-process; compare losses, parameters; check the received
    hidden-state shape (``received``: what every non-first stage gets)."""
    torch.manual_seed(0)
    model = build(family, layers, tied)
    ref = copy.deepcopy(model)
    initial = snapshot(model.named_parameters(remove_duplicate=False))
    ref_opt = adamw(ref)
    run = Pipelined(model, family, **plugin_kwargs)
    batch = make_batch(family)
    losses, ref_losses = [], []
    for _ in range(STEPS):
        losses.append(run.step(batch))
        ref_loss = sum(ref(**{k: shard(v, i, MICRO) for k, v in batch.items()}).loss
                       for i in range(MICRO)) / MICRO  # fmt: skip
        ref_loss.backward()
        if plugin_kwargs.get("max_norm"):  # the plugin clips by the whole model's norm
            torch.nn.utils.clip_grad_norm_(ref.parameters(), plugin_kwargs["max_norm"])
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    torch.testing.assert_close(losses, ref_losses, rtol=TOL, atol=TOL)
    if received is not None:  # one shard per micro-batch and non-first chunk
        assert len(run.received) == STEPS * MICRO * run.later_chunks, run.received
        assert set(run.received) <= {received}, run.received
    trained = run.full_params()
    theirs = dict(ref.named_parameters(remove_duplicate=False))  # tied copies on two stages
    assert {id(theirs[n]) for n in trained} == {id(p) for p in theirs.values()}
    for name, value in trained.items():
        torch.testing.assert_close(value, theirs[name].detach(), rtol=TOL, atol=TOL, msg=name)
    still = [n for n in trained if n.endswith(ZERO_GRADIENT)]
    assert_moved(initial, trained, TOL, exclude=still)
    return run


SHARD = (GLOBAL_BATCH // MICRO, SEQ // 2, HIDDEN)
"""What a stage receives per micro-batch with the sequence split in two."""


@distributed(4)
def test_pp2_tp2_split_gather_matches_single_process(build: Callable[..., nn.Module]) -> None:
    @parameterize("family", ["gpt2", "llama", "bert"])
    def case(family: str) -> None:
        run = check(build, family, tp_size=2, received=SHARD)
        assert run.plugin.mesh.dp_size == 1 and run.plugin.mesh.sp_size == 1

    case()

    # two chunks per rank: the shard crosses three stage boundaries
    @parameterize("schedule", ["interleaved", "zbv"])
    def schedules(schedule: str) -> None:
        check(build, "gpt2", layers=4, tp_size=2, received=SHARD, pp_style=schedule,
              num_model_chunks=2)  # fmt: skip

    schedules()
    # every block recomputed: the scatter / gather hooks stay outside the checkpoints
    ckpt = GradientCheckpointConfig(gradient_checkpointing_ratio=1.0)
    run = check(build, "llama", tp_size=2, received=SHARD, gradient_checkpoint_config=ckpt)
    assert run.attention_calls == 2 * STEPS * MICRO, run.attention_calls


@distributed(4)
def test_pp2_sp2_zero_and_schedules_match_single_process(
    build: Callable[..., nn.Module],
) -> None:
    # ZeRO-1 / ZeRO-2 over dp x sp (dp 1: the two SP ranks); ZeRO-2 needs untied weights
    @parameterize("zero_stage", [1, 2])
    @parameterize("mode", ["all_to_all", "ring_attn"])
    def zero(zero_stage: int, mode: str) -> None:
        run = check(build, "llama", received=SHARD, sp_size=2, sequence_parallelism_mode=mode,
                    zero_stage=zero_stage, max_norm=1.0)  # fmt: skip
        assert run.plugin.mesh.dp_size == 1 and run.plugin.mesh.sp_size == 2

    zero()

    @parameterize("schedule", ["interleaved", "zbv"])
    @parameterize("mode", ["all_to_all", "ring_attn"])
    def schedules(schedule: str, mode: str) -> None:
        check(build, "gpt2", layers=4, received=SHARD, sp_size=2, sequence_parallelism_mode=mode,
              pp_style=schedule, num_model_chunks=2)  # fmt: skip

    schedules()


@distributed(4)
def test_pp2_sp2_gradient_checkpointing_matches_single_process(
    build: Callable[..., nn.Module],
) -> None:
    """Every block recomputed in backward: the first stage's backward of micro-batch 0 comes
    after the forward of micro-batch 1 (1F1B), whose padding differs, so a recomputation that
    read the latest micro-batch's mask shard would fail the comparison."""

    @parameterize("family", ["gpt2", "llama", "bert"])
    @parameterize("mode", ["all_to_all", "ring_attn"])
    def case(family: str, mode: str) -> None:
        run = check(build, family, received=SHARD, sp_size=2, sequence_parallelism_mode=mode,
                    gradient_checkpoint_config=GradientCheckpointConfig(
                        gradient_checkpointing_ratio=1.0))  # fmt: skip
        # one block per stage: its attention runs twice per micro-batch (forward, recompute)
        assert run.attention_calls == 2 * STEPS * MICRO, run.attention_calls

    case()
