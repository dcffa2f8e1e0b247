"""HybridParallelPlugin's ShardFormer / ZeRO options, each against the same run without it.

For every option the boosted model trains twice on the same batches, once with the option and
once without (fp32, dropout off unless stated): losses at every step and all parameters at the
end must agree tightly, and the option's effect is checked where the CPU can show it: the SDPA
kernel is called (a spy), RMSNorms run ``F.rms_norm``, the fused dropout + add runs, the chosen
blocks are recomputed (fewer activation bytes kept), and ZeRO's parameter gathers are waited on
in forward pre-hooks instead of in ``step``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from kolossos.accelerator.memory_tracker import TensorMemoryTracker
from kolossos.booster import Booster
from kolossos.booster.plugin import HybridParallelPlugin
from kolossos.interface import unwrap_model
from kolossos.nn.layer.parallel_1d import gather_tp_full, get_tp_spec
from kolossos.shardformer import GradientCheckpointConfig, PipelineGradientCheckpointConfig
from kolossos.shardformer.layer import fused
from kolossos.shardformer.layer.normalization import TorchRMSNorm
from kolossos.shardformer.optimizations import CHECKPOINTED_ATTR
from kolossos.testing import distributed, parameterize
from kolossos.testing.parity import assert_moved, global_mean, shard, snapshot

pytestmark = pytest.mark.dist

STEPS = 4
BATCH = 4
SEQ = 16
LAYERS = 4
TOL = 2e-6  # fp32: the options only reorder a few float32 operations (or none)
# Every parameter must move by MOVE_EACH x TOL, the largest move by 10 x TOL: at initialisation
# attention is nearly uniform, so BERT's query biases get tiny gradients and move only ~1.5e-5
# in the few AdamW steps (eps 1e-3).
MOVE_EACH = 5.0
FAMILIES = ("gpt2", "llama", "opt", "bert", "vit")


def build(family: str, dropout: float = 0.0) -> nn.Module:
    """A tiny transformers model of ``family`` with eager attention."""
    tf = pytest.importorskip("transformers")
    d = dropout
    configs: dict[str, Callable[[], Any]] = {
        "gpt2": lambda: tf.GPT2LMHeadModel(tf.GPT2Config(
            vocab_size=128, n_positions=SEQ, n_embd=32, n_layer=LAYERS, n_head=4,
            attn_pdrop=d, resid_pdrop=d, embd_pdrop=d, bos_token_id=0, eos_token_id=0)),
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
            attention_dropout=d, bos_token_id=0, eos_token_id=0, pad_token_id=0)),
        "opt": lambda: tf.OPTForCausalLM(tf.OPTConfig(
            vocab_size=128, hidden_size=32, ffn_dim=64, num_hidden_layers=LAYERS,
            num_attention_heads=4, max_position_embeddings=SEQ, word_embed_proj_dim=32,
            dropout=d, attention_dropout=d, activation_function="gelu", bos_token_id=0,
            eos_token_id=0, pad_token_id=1)),
        "bert": lambda: tf.BertForSequenceClassification(tf.BertConfig(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
            num_attention_heads=4, max_position_embeddings=SEQ, num_labels=3,
            hidden_dropout_prob=d, attention_probs_dropout_prob=d)),
        "vit": lambda: tf.ViTForImageClassification(tf.ViTConfig(
            image_size=12, patch_size=4, num_channels=3, hidden_size=32, intermediate_size=64,
            num_hidden_layers=LAYERS, num_attention_heads=4, num_labels=3,
            hidden_dropout_prob=d, attention_probs_dropout_prob=d)),
    }  # fmt: skip
    model = configs[family]()
    model.set_attn_implementation("eager")
    return model


def batches(family: str, steps: int = STEPS) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps):
        if family == "vit":
            out.append({"pixel_values": torch.randn(BATCH, 3, 12, 12, generator=gen),
                        "labels": torch.randint(0, 3, (BATCH,), generator=gen)})  # fmt: skip
        elif family == "bert":
            mask = torch.ones(BATCH, SEQ, dtype=torch.long)
            mask[0, -5:] = 0  # padding: the attention mask path
            out.append({"input_ids": torch.randint(2, 128, (BATCH, SEQ), generator=gen),
                        "attention_mask": mask,
                        "labels": torch.randint(0, 3, (BATCH,), generator=gen)})  # fmt: skip
        else:
            ids = torch.randint(2, 128, (BATCH, SEQ), generator=gen)
            out.append({"input_ids": ids, "labels": ids})
    return out


def full_params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: gather_tp_full(p.detach(), spec) if (spec := get_tp_spec(p)) is not None
        else p.detach().clone()
        for name, p in module.named_parameters()
    }  # fmt: skip


def train(
    model: nn.Module, family: str, tp: int, seed: int = 0, **options: Any
) -> tuple[list[float], dict[str, torch.Tensor], Any, nn.Module, dict[str, torch.Tensor]]:
    """Train through the plugin (fp32, AdamW); losses, full parameters, optimizer, module and
    the initial (dense) parameters."""
    initial = snapshot(dict(model.named_parameters(remove_duplicate=False)))  # tied: each name
    dp, dp_rank = dist.get_world_size() // tp, dist.get_rank() // tp
    plugin = HybridParallelPlugin(tp_size=tp, precision="fp32", **options)
    booster = Booster(plugin=plugin)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)
    boosted, opt, _, _, _ = booster.boost(model, opt)
    torch.manual_seed(seed)  # the same dropout stream for both runs
    losses = []
    for batch in batches(family):
        loss = boosted(**{k: shard(v, dp_rank, dp) for k, v in batch.items()}).loss
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        losses.append(global_mean(loss))
    if hasattr(opt, "wait_param_gather"):  # overlap_allgather: the last step's gathers
        opt.wait_param_gather()
    module = unwrap_model(boosted)
    return losses, full_params(module), opt, module, initial


def _key_biases(params: dict[str, torch.Tensor]) -> list[str]:
    """A separate key projection's bias: softmax over keys is invariant to it, so its gradient
    is zero (up to rounding) and it never moves."""
    return [n for n in params if n.endswith(("k_proj.bias", "self.key.bias"))]


def assert_same(off: Any, on: Any, tol: float = TOL) -> None:
    """Losses every step and parameters at the end equal the option-off run's, and training
    moved the parameters far beyond ``tol`` (else the comparison could not fail)."""
    assert_moved(off[4], off[1], tol, each=MOVE_EACH, exclude=_key_biases(off[1]))
    torch.testing.assert_close(on[0], off[0], rtol=tol, atol=tol)
    assert on[1].keys() == off[1].keys()
    for name, value in on[1].items():
        torch.testing.assert_close(value, off[1][name], rtol=tol, atol=tol, msg=name)


@contextmanager
def spy(owner: Any, name: str) -> Iterator[list[int]]:
    """Count the calls of ``owner.name`` while the context is open."""
    calls = [0]
    original = getattr(owner, name)

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    setattr(owner, name, counting)
    try:
        yield calls
    finally:
        setattr(owner, name, original)


def compare(family: str, tp: int, **options: Any) -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = build(family)
    twin = copy.deepcopy(model)
    off = train(model, family, tp, **{k: v for k, v in options.items() if k == "zero_stage"})
    on = train(twin, family, tp, **options)
    assert_same(off, on)
    return off, on


@distributed(2)
def test_flash_attention_fused_norm_and_jit_match_option_off() -> None:
    """tp 2: each option alone, every family: the same numbers, and the option's kernel runs."""

    @parameterize("family", FAMILIES)
    def flash(family: str) -> None:
        with spy(F, "scaled_dot_product_attention") as calls:
            _, on = compare(family, 2, enable_flash_attention=True)
        assert on[3].config._attn_implementation == "sdpa"
        assert calls[0] == STEPS * LAYERS  # one SDPA call per layer and forward

    @parameterize("family", FAMILIES)
    def fused_norm(family: str) -> None:
        with spy(F, "rms_norm") as calls:
            _, on = compare(family, 2, enable_fused_normalization=True)
        norms = [m for m in on[3].modules() if isinstance(m, TorchRMSNorm)]
        if family == "llama":  # 2 per layer + the final norm, each one F.rms_norm call
            assert len(norms) == 2 * LAYERS + 1
            assert calls[0] == STEPS * len(norms)
        else:  # nn.LayerNorm already is the fused kernel: kept
            assert not norms and any(isinstance(m, nn.LayerNorm) for m in on[3].modules())

    @parameterize("family", FAMILIES)
    def jit(family: str) -> None:
        with spy(fused, "dropout_add") as calls:
            compare(family, 2, enable_jit_fused=True)
        per_layer = {"gpt2": 2, "opt": 2, "vit": 2, "bert": 2, "llama": 0}[family]
        assert calls[0] == STEPS * LAYERS * per_layer

    flash()
    fused_norm()
    jit()
    # all at once (enable_all_optimization), with sequence parallelism and ZeRO-1
    compare("gpt2", 2, enable_all_optimization=True, enable_sequence_parallelism=True,
            zero_stage=1)  # fmt: skip
    compare("llama", 2, enable_all_optimization=True, zero_stage=1)


@distributed(2)
def test_jit_fused_keeps_dropout_masks() -> None:
    """Dropout on, tp 1 (dp 2): the fused dropout + add draws the very masks of the unfused
    model (same generator, same order), so the runs agree exactly."""

    @parameterize("family", ["gpt2", "opt", "vit", "bert"])
    def case(family: str) -> None:
        torch.manual_seed(0)
        model = build(family, dropout=0.1)
        twin = copy.deepcopy(model)
        off = train(model, family, 1, seed=5)
        on = train(twin, family, 1, seed=5, enable_jit_fused=True)
        assert_same(off, on, tol=1e-6)

    case()


def _activation_bytes(model: nn.Module, opt: Any, batch: dict[str, torch.Tensor]) -> int:
    """Bytes of the storages a training forward allocates and keeps alive for backward."""
    model.train()
    with TensorMemoryTracker("cpu") as tracker:
        loss = model(**batch).loss
        kept = tracker.current_bytes
    opt.backward(loss)  # ZeRO: through the optimizer
    opt.zero_grad()
    return kept


@distributed(2)
def test_gradient_checkpointing_matches_and_saves_memory() -> None:
    """tp 2: ratio 0.5 and 1.0 give the numbers of no checkpointing; the activations kept by a
    forward fall with the number of recomputed layers."""

    @parameterize("family", FAMILIES)
    def case(family: str) -> None:
        for ratio in (0.5, 1.0):
            ckpt = GradientCheckpointConfig(gradient_checkpointing_ratio=ratio)
            with spy(torch.utils.checkpoint, "checkpoint") as calls:
                off, on = compare(family, 2, gradient_checkpoint_config=ckpt, zero_stage=1)
            blocks = [m for m in on[3].modules() if getattr(m, CHECKPOINTED_ATTR, False)]
            assert len(blocks) == int(ratio * LAYERS)
            assert calls[0] == STEPS * len(blocks)  # each checkpointed block, every forward
            batch = {k: shard(v, dist.get_rank() // 2, 1) for k, v in batches(family, 1)[0].items()}
            kept_off = _activation_bytes(off[3], off[2], batch)
            kept_on = _activation_bytes(on[3], on[2], batch)
            assert kept_on < kept_off, (family, ratio, kept_on, kept_off)
            if dist.get_rank() == 0:
                print(f"{family} ratio {ratio}: kept {kept_on} B vs {kept_off} B")

    case()


def run_pipeline(**options: Any) -> tuple[Any, ...]:
    """GPT-2 through pp 2 (1F1B, 2 micro-batches), fp32: losses, this rank's parameters, the
    stage chunks, the optimizer and the initial parameters."""
    torch.manual_seed(0)
    model = build("gpt2")
    initial = snapshot(dict(model.named_parameters(remove_duplicate=False)))  # tied: each name
    plugin = HybridParallelPlugin(tp_size=1, pp_size=2, num_microbatches=2, precision="fp32",
                                  **options)  # fmt: skip
    booster = Booster(plugin=plugin)
    boosted, opt, _, _, _ = booster.boost(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)
    )
    losses = []
    for batch in batches("gpt2"):
        out = booster.execute_pipeline(iter([batch]), boosted, lambda o, i: o.loss, opt,
                                       return_loss=True)  # fmt: skip
        opt.step()
        opt.zero_grad()
        loss = out["loss"]
        value = torch.tensor(float(loss) if loss is not None else 0.0)
        dist.all_reduce(value)  # only the last stage holds the loss
        losses.append(value.item())
    if hasattr(opt, "wait_param_gather"):
        opt.wait_param_gather()
    module = unwrap_model(boosted)
    params = {n: p.detach().clone() for n, p in module.named_parameters()}
    return losses, params, module, opt, initial


def assert_same_pipeline(off: Any, on: Any) -> None:
    """As :func:`assert_same` for this stage's parameters."""
    stage = {name.split(".", 1)[1]: p for name, p in off[1].items()}  # "<chunk>.<model name>"
    assert_moved(off[4], stage, TOL, each=MOVE_EACH, exclude=_key_biases(stage))
    torch.testing.assert_close(on[0], off[0], rtol=TOL, atol=TOL)
    assert on[1].keys() == off[1].keys()
    for name, value in on[1].items():
        torch.testing.assert_close(value, off[1][name], rtol=TOL, atol=TOL, msg=name)


@distributed(2)
def test_gradient_checkpointing_per_pipeline_stage() -> None:
    """pp 2: one checkpointed layer on each stage (PipelineGradientCheckpointConfig) and a
    ratio, against the pipeline without checkpointing."""
    run = run_pipeline
    off = run()
    for ckpt in (
        PipelineGradientCheckpointConfig(num_ckpt_layers_per_stage=[1, 1]),
        GradientCheckpointConfig(gradient_checkpointing_ratio=1.0),
    ):
        on = run(gradient_checkpoint_config=ckpt)
        assert_same_pipeline(off, on)
        blocks = {m for m in on[2].modules() if getattr(m, CHECKPOINTED_ATTR, False)}
        per_stage = 1 if isinstance(ckpt, PipelineGradientCheckpointConfig) else LAYERS // 2
        assert len(blocks) == per_stage


@distributed(2)
def test_overlap_allgather_waits_in_forward_hooks() -> None:
    """ZeRO-1/2 over dp 2: the step only starts the gathers; the modules' forward pre-hooks wait
    for them; the numbers equal the synchronous gather's."""

    @parameterize("family", ["gpt2", "llama"])
    @parameterize("zero_stage", [1, 2])
    def case(family: str, zero_stage: int) -> None:
        torch.manual_seed(0)
        model = build(family)
        twin = copy.deepcopy(model)
        off = train(model, family, 1, zero_stage=zero_stage, zero_bucket_size_in_m=2**-10)
        on = train(twin, family, 1, zero_stage=zero_stage, zero_bucket_size_in_m=2**-10,
                   overlap_allgather=True)  # fmt: skip
        gatherer = on[2].gatherer
        assert gatherer is not None and len(gatherer.buckets) > 1  # 1024-element buckets
        # every step but the last: each bucket waited on by a module's forward pre-hook; the
        # last step's gathers were still in flight until train() called wait_param_gather
        assert gatherer.waited_in_forward == (STEPS - 1) * len(gatherer.buckets)
        assert gatherer.waited_outside == len(gatherer.buckets)
        assert_same(off, on)

    case()


@distributed(4)
def test_overlap_allgather_with_a_pipeline() -> None:
    """pp 2 x dp 2, ZeRO-1: the stage chunks' modules wait for their gathers."""
    off = run_pipeline(zero_stage=1)
    on = run_pipeline(zero_stage=1, overlap_allgather=True, zero_bucket_size_in_m=2**-10)
    gatherer = on[3].gatherer
    assert gatherer.waited_in_forward == (STEPS - 1) * len(gatherer.buckets)
    assert_same_pipeline(off, on)


def _single_process(model: nn.Module, family: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same training in one process, whole batches, plain module (the reference)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-3)
    losses = []
    for batch in batches(family):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@distributed(2)
def test_aligned_lm_head_matches_single_process() -> None:
    """dp 2 at tp 1: the LM head's products over the padded vocabulary (128 rows padded to 192,
    the padded path forced on the CPU) train exactly as one process with the plain head."""
    from kolossos.shardformer.layer.aligned_head import AlignedLMHead

    torch.manual_seed(0)
    model = build("gpt2")
    reference = copy.deepcopy(model)
    ref_losses, ref_params = _single_process(reference, "gpt2")
    devices = AlignedLMHead.devices
    AlignedLMHead.devices = ("cpu",)
    try:
        with spy(F, "pad") as pads:
            losses, params, _, module, initial = train(model, "gpt2", 1,
                                                       make_vocab_size_divisible_by=96)  # fmt: skip
    finally:
        AlignedLMHead.devices = devices
    head = module.lm_head
    assert type(head) is AlignedLMHead and head.weight is module.transformer.wte.weight
    assert head.weight.shape == (128, 32) and pads[0] >= STEPS  # the padded product ran
    tol = 1e-5  # dp 2 sums the gradients in another order than one process
    assert_moved(initial, params, tol, each=MOVE_EACH)
    torch.testing.assert_close(losses, ref_losses, rtol=tol, atol=tol)
    assert params.keys() == ref_params.keys()
    for name, value in params.items():
        torch.testing.assert_close(value, ref_params[name], rtol=tol, atol=tol, msg=name)
