"""ShardFormer plans (GPT-2, LLaMA, BERT, ViT, OPT and a custom plan) vs the unsharded model on
CPU/gloo.

Every rank builds the same seeded tiny model (2 layers, hidden 32, 4 heads, vocabulary 128) and
keeps a deep copy as the single-process reference. The copy is sharded over the tensor-parallel
group; both see the same batch (tensor parallelism splits weights, not data). Compared: the loss,
and every gradient gathered back to full size with ``gather_tp_full`` (after the
sequence-parallel all-reduce of the marked norm gradients); for GPT-2 and LLaMA also three AdamW
steps (losses at every step, gathered parameters at the end). Also checked: local and gathered
logits, tied weights, the replaced loss, the collectives per step, dropout masks on replicated
activations, gradient checkpointing with dropout, and the errors. One spawned job per world size.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import transformers as tf
from torch import nn

from kolossos.nn.layer.parallel_1d import (
    all_reduce_sequence_parallel_grads,
    gather_tp_full,
    get_tp_spec,
)
from kolossos.shardformer import (
    BlockPlan,
    Divisible,
    ModelPlan,
    ParallelLayer,
    Policy,
    SequenceBoundary,
    ShardConfig,
    ShardFormer,
    StageLayout,
    TPRegion,
)
from kolossos.testing import distributed, parameterize
from kolossos.testing.parity import assert_moved, assert_same_on_all_ranks, snapshot
from kolossos.utils.profiling import CommCounter

VOCAB, HIDDEN, HEADS, BATCH, SEQ = 128, 32, 4, 2, 8
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# (loss, gradient) rtol = atol; the gradient tolerance is a fraction of each parameter's largest
# reference gradient (at least 1e-3; ``assert_close_named(scaled=True)``), so a missing or wrong
# gradient fails however small the gradients are. fp32 differs only in the order of the sums
# split over ranks (measured worst: 5e-7 on losses, 6e-7 of the gradient's scale). In bf16 every
# matmul output is rounded to 8 mantissa bits and each rank rounds its partial sums before the
# reduction: the sharded gradients then differ from the single-process bf16 ones by as much as
# those differ from fp32 (measured worst: 2e-2 of the gradient's scale, 1.4e-4 on losses). The
# gradient tolerances were absolute, 2e-5 and 6e-2 (a few times OPT's fc1.weight difference
# under ReLU flips, 2.6e-2; OPT now uses GELU): the bf16 one was above the largest gradient of
# most parameters (the largest of all is 0.2-0.9), and BERT's first query bias has gradients
# below 1e-5, so a missing gradient passed.
TOL = {"fp32": (2e-5, 1e-5), "bf16": (1e-3, 5e-2)}
QUIET = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}


def gpt2(dropout: float = 0.0) -> nn.Module:
    return tf.GPT2LMHeadModel(
        tf.GPT2Config(
            vocab_size=VOCAB,
            n_positions=32,
            n_embd=HIDDEN,
            n_layer=2,
            n_head=HEADS,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            **QUIET,
        )
    )


def llama() -> nn.Module:
    return tf.LlamaForCausalLM(
        tf.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=HEADS,
            num_key_value_heads=2,
            max_position_embeddings=32,
            **QUIET,
        )
    )


def bert() -> nn.Module:
    return tf.BertForMaskedLM(
        tf.BertConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            num_hidden_layers=2,
            num_attention_heads=HEADS,
            intermediate_size=64,
            max_position_embeddings=32,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            pad_token_id=0,
        )
    )


def vit() -> nn.Module:
    # 24 / 8 = 3x3 patches + CLS = 10 tokens, so the sequence splits over 2 ranks.
    return tf.ViTForImageClassification(
        tf.ViTConfig(
            image_size=24,
            patch_size=8,
            hidden_size=HIDDEN,
            num_hidden_layers=2,
            num_attention_heads=HEADS,
            intermediate_size=64,
            num_labels=4,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    )


def opt() -> nn.Module:
    return tf.OPTForCausalLM(
        tf.OPTConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=HEADS,
            max_position_embeddings=32,
            word_embed_proj_dim=HIDDEN,
            dropout=0.0,
            attention_dropout=0.0,
            activation_function="gelu",  # not ReLU: see TOL (the plan does not depend on it)
            **QUIET,
        )
    )


FAMILIES: dict[str, Callable[[], nn.Module]] = {
    "gpt2": gpt2,
    "llama": llama,
    "bert": bert,
    "vit": vit,
    "opt": opt,
}


def make_batch(family: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """A batch identical on every rank (all ranks of a tensor-parallel group see the same data)."""
    gen = torch.Generator().manual_seed(seed)
    if family == "vit":
        return {
            "pixel_values": torch.randn(BATCH, 3, 24, 24, generator=gen),
            "labels": torch.randint(0, 4, (BATCH,), generator=gen),
        }
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=gen)
    if family == "bert":
        labels = torch.where(torch.rand(BATCH, SEQ, generator=gen) < 0.5, ids, -100)
        return {"input_ids": ids, "labels": labels}
    return {"input_ids": ids, "labels": ids}


def shard(model: nn.Module, sp: bool, **kwargs: Any) -> tuple[nn.Module, list[Any]]:
    config = ShardConfig(enable_sequence_parallelism=sp, **kwargs)
    return ShardFormer(config).optimize(model)


def full_grads(model: nn.Module, sp: bool) -> dict[str, torch.Tensor]:
    """Every gradient at full size. COLLECTIVE."""
    if sp:
        all_reduce_sequence_parallel_grads(model, dist.group.WORLD)
    grads = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} has no gradient"
        spec = get_tp_spec(p)
        grads[name] = gather_tp_full(p.grad, spec) if spec is not None else p.grad
    return grads


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter at full size. COLLECTIVE."""
    out = {}
    for name, p in model.named_parameters():
        spec = get_tp_spec(p)
        out[name] = gather_tp_full(p.detach(), spec) if spec is not None else p.detach()
    return out


def replicated(model: nn.Module) -> nn.Module:
    """The model's replicated (unsharded) parameters, as a module."""
    return nn.ParameterList([p for p in model.parameters() if get_tp_spec(p) is None])


def assert_close_named(
    actual: dict[str, torch.Tensor],
    expected: nn.Module,
    what: str,
    tol: float,
    case: str,
    scaled: bool = False,
) -> None:
    """``actual`` equals ``expected``'s parameters or gradients by name: rtol = atol = ``tol``;
    with ``scaled``, atol is ``tol`` times each reference tensor's largest element (at least
    1e-3)."""
    ref = dict(expected.named_parameters())
    assert actual.keys() == ref.keys(), f"{case}: names differ {sorted(actual.keys() ^ ref.keys())}"
    for name, value in actual.items():
        target = ref[name].grad if what == "grad" else ref[name].detach()
        assert target is not None
        atol = tol * max(float(target.abs().max()), 1e-3) if scaled else tol
        torch.testing.assert_close(
            value.float(),
            target.float(),
            rtol=tol,
            atol=atol,
            msg=lambda m, n=name: f"{case}: {what} of {n}: {m}",  # type: ignore[misc]
        )


def check_forward_backward(family: str, sp: bool, precision: str) -> None:
    case = f"{family} tp={dist.get_world_size()} sp={sp} {precision}"
    dtype = DTYPES[precision]
    torch.manual_seed(0)
    model = FAMILIES[family]().to(dtype)
    ref = copy.deepcopy(model)
    sharded, _ = shard(model, sp)
    assert sharded.state_dict().keys() == ref.state_dict().keys(), f"{case}: names changed"
    batch = make_batch(family)
    if "pixel_values" in batch:
        batch["pixel_values"] = batch["pixel_values"].to(dtype)
    loss = sharded(**batch).loss
    ref_loss = ref(**batch).loss
    loss_tol, grad_tol = TOL[precision]
    torch.testing.assert_close(
        loss.float(),
        ref_loss.float(),
        rtol=loss_tol,
        atol=loss_tol,
        msg=lambda m: f"{case}: loss {m}",
    )
    loss.backward()
    ref_loss.backward()
    grads = full_grads(sharded, sp)
    # scaled: every tolerance is a small fraction of its gradient's largest element (20x below
    # it in bf16), so the comparison cannot pass a missing gradient
    assert_close_named(grads, ref, "grad", grad_tol, case, scaled=True)


def check_training(family: str, sp: bool, steps: int = 3) -> None:
    """``steps`` AdamW steps on the sharded model equal the same steps in one process."""
    case = f"train {family} tp={dist.get_world_size()} sp={sp}"
    torch.manual_seed(0)
    model = FAMILIES[family]()
    ref = copy.deepcopy(model)
    initial = snapshot(model)
    sharded, _ = shard(model, sp)
    # eps=1e-5: GPT-2's key bias has an exactly-zero true gradient (softmax ignores a constant
    # added to every key) whose ~1e-9 rounding noise Adam with eps=1e-8 would turn into full
    # lr-sized steps of either sign; the real gradients here are >= 1e-3, so eps barely acts.
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-5)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-5)
    losses, ref_losses = [], []
    for step in range(steps):
        batch = make_batch(family, seed=step)
        loss = sharded(**batch).loss
        loss.backward()
        if sp:
            all_reduce_sequence_parallel_grads(sharded, dist.group.WORLD)
        opt.step()
        opt.zero_grad()
        ref_loss = ref(**batch).loss
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
    # Adam divides by sqrt(v): fp32 summation-order differences in tiny gradients grow to ~1e-5.
    torch.testing.assert_close(
        losses, ref_losses, rtol=1e-5, atol=1e-5, msg=lambda m: f"{case}: losses {m}"
    )
    params = full_params(sharded)
    assert_close_named(params, ref, "param", 1e-4, case)
    assert_moved(initial, params, 1e-4)
    assert_same_on_all_ranks(replicated(sharded))


def check_gpt2_outputs() -> None:
    """Logits: the vocabulary-local slice by default, the full logits with parallel_output=False;
    tied weights stay one sharded parameter; head counts are local."""
    tp, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = gpt2()
    ref_logits = copy.deepcopy(model)(input_ids=make_batch("gpt2")["input_ids"]).logits
    sharded, shared = shard(copy.deepcopy(model), sp=False)
    local = sharded(input_ids=make_batch("gpt2")["input_ids"]).logits
    width = VOCAB // tp
    torch.testing.assert_close(local, ref_logits[..., rank * width : (rank + 1) * width])
    assert sharded.lm_head.weight is sharded.transformer.wte.weight
    assert len(shared) == 1 and set(shared[0]) == {"transformer.wte.weight", "lm_head.weight"}
    assert shared[0]["lm_head.weight"] is sharded.lm_head.weight
    attn = sharded.transformer.h[0].attn
    assert (attn.num_heads, attn.split_size) == (HEADS // tp, HIDDEN // tp)
    gathered, _ = shard(copy.deepcopy(model), sp=True, parallel_output=False)
    torch.testing.assert_close(
        gathered(input_ids=make_batch("gpt2")["input_ids"]).logits, ref_logits
    )
    # The replaced loss honours ignored labels and the trainer's num_items_in_batch like
    # transformers' ForCausalLMLoss on the full logits.
    labels = make_batch("gpt2")["input_ids"].masked_fill(torch.arange(SEQ) % 3 == 0, -100)
    for items in (None, torch.tensor(5)):
        got = sharded.loss_function(local, labels, VOCAB, num_items_in_batch=items)
        want = model.loss_function(ref_logits, labels, VOCAB, num_items_in_batch=items)
        torch.testing.assert_close(got, want)


def check_dropout_masks(sp: bool) -> None:
    """With dropout on, activations replicated over the group keep identical masks on every
    rank (so replicated parameters stay identical after a step), and the model still trains."""
    torch.manual_seed(0)
    sharded, _ = shard(gpt2(dropout=0.2), sp)
    opt = torch.optim.SGD(sharded.parameters(), lr=0.1)
    loss = sharded(**make_batch("gpt2")).loss
    loss.backward()
    if sp:
        all_reduce_sequence_parallel_grads(sharded, dist.group.WORLD)
    for grad in [p.grad for p in sharded.parameters() if get_tp_spec(p) is None]:
        ref = grad.clone()
        dist.broadcast(ref, src=0)
        assert torch.equal(grad, ref), "replicated gradients differ across tensor-parallel ranks"
    opt.step()
    assert_same_on_all_ranks(replicated(sharded))


def check_gradient_checkpointing(sp: bool) -> None:
    """With dropout on, transformers' gradient checkpointing recomputes every block with the
    same masks (the tensor-parallel RNG streams derive from the default generator, which
    checkpointing restores): loss and gradients equal those of the model without it."""
    torch.manual_seed(0)
    plain = gpt2(dropout=0.2)
    recomputed = copy.deepcopy(plain)
    recomputed.gradient_checkpointing_enable()
    results = []
    for model in (plain, recomputed):
        sharded, _ = shard(model, sp)
        torch.manual_seed(5)
        loss = sharded(**make_batch("gpt2"), use_cache=False).loss
        loss.backward()
        results.append((loss, full_grads(sharded, sp)))
    (loss, grads), (ck_loss, ck_grads) = results
    torch.testing.assert_close(ck_loss, loss)
    for name, grad in grads.items():
        torch.testing.assert_close(ck_grads[name], grad, msg=lambda m, n=name: f"sp={sp} {n}: {m}")


def check_communication() -> None:
    """LLaMA (2 blocks): one communication per TP region entry and per row layer, nothing more.

    Without SP, forward: embedding all-reduce, o_proj and down_proj all-reduces per block, two
    for the vocabulary-parallel loss = 7; backward: one all-reduce per region entry (attention,
    MLP) per block and one at the LM head's input = 5. With SP, forward: per block two region
    all-gathers and two row reduce-scatters, plus the final gather; backward mirrors it, plus the
    all-gather of the split's gradient."""
    expected = {
        False: ({("all_reduce", "world"): 7}, {("all_reduce", "world"): 5}),
        True: (
            {
                ("all_reduce", "world"): 3,
                ("all_gather", "world"): 5,
                ("reduce_scatter", "world"): 4,
            },
            {
                ("all_reduce", "world"): 1,
                ("all_gather", "world"): 5,
                ("reduce_scatter", "world"): 4,
            },
        ),
    }
    for sp, (fwd_calls, bwd_calls) in expected.items():
        torch.manual_seed(0)
        sharded, _ = shard(llama(), sp)
        with CommCounter() as fwd:
            loss = sharded(**make_batch("llama")).loss
        with CommCounter() as bwd:
            loss.backward()
        assert {k: v.calls for k, v in fwd.stats.items()} == fwd_calls, f"sp={sp} forward"
        assert {k: v.calls for k, v in bwd.stats.items()} == bwd_calls, f"sp={sp} backward"


class ToyBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(16), nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Toy(nn.Module):
    """A model no built-in plan knows: embedding, two MLP blocks, norm, head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.blocks = nn.ModuleList([ToyBlock(), ToyBlock()])
        self.norm, self.head = nn.LayerNorm(16), nn.Linear(16, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


class ToyPolicy(Policy):
    def plan(self, model: nn.Module) -> ModelPlan:
        return ModelPlan(
            family="toy",
            layout=StageLayout(embeddings=("embed",), blocks="blocks", final=("norm", "head")),
            block=BlockPlan(
                layers=(
                    ParallelLayer(path="up", style="column"),
                    ParallelLayer(path="down", style="row"),
                ),
                regions=(TPRegion(path="up", arg="input"),),
                sequence_norms=("norm",),
            ),
            layers=(
                ParallelLayer(path="embed", style="vocab_embedding"),
                ParallelLayer(path="head", style="lm_head"),
            ),
            divisible=(Divisible(name="MLP width", value=32),),
            sequence=SequenceBoundary(gather_after="norm", split_arg="x", norms=("norm",)),
        )


def check_custom_plan(sp: bool) -> None:
    """A user plan for a model of its own: same loss and gradients as the unsharded model (the
    head gathers its logits: the model computes no loss itself)."""
    case = f"toy tp={dist.get_world_size()} sp={sp}"
    torch.manual_seed(0)
    model = Toy()
    ref = copy.deepcopy(model)
    ShardFormer(ShardConfig(enable_sequence_parallelism=sp)).optimize(model, policy=ToyPolicy())
    ids = make_batch("gpt2")["input_ids"]
    loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
    ref_loss = nn.functional.cross_entropy(ref(ids).flatten(0, 1), ids.flatten())
    torch.testing.assert_close(loss, ref_loss, msg=lambda m: f"{case}: loss {m}")
    loss.backward()
    ref_loss.backward()
    assert_close_named(full_grads(model, sp), ref, "grad", TOL["fp32"][1], case, scaled=True)


def check_deepcopy_under_sp() -> None:
    """A deep copy of a sequence-parallel model (new parameter objects) still trains right: the
    shard specs and the sequence-parallel marks of its norms come back."""
    torch.manual_seed(0)
    model = gpt2()
    ref = copy.deepcopy(model)
    sharded, _ = shard(model, sp=True)
    clone = copy.deepcopy(sharded)
    batch = make_batch("gpt2")
    clone(**batch).loss.backward()
    ref(**batch).loss.backward()
    grads = full_grads(clone, sp=True)
    assert_close_named(grads, ref, "grad", TOL["fp32"][1], "deepcopy sp", scaled=True)


def check_sequence_not_divisible() -> None:
    """Under SP a sequence length the group does not divide fails clearly on every rank."""
    torch.manual_seed(0)
    sharded, _ = shard(gpt2(), sp=True)
    try:
        sharded(input_ids=torch.ones(BATCH, SEQ - 1, dtype=torch.long))
    except ValueError as error:
        assert "not divisible by the tensor-parallel size" in str(error)
    else:
        raise AssertionError("an odd sequence length was split over 2 ranks")


def check_refused_before_any_change() -> None:
    """LLaMA with one KV head cannot be split over 2 ranks: the error comes before any change."""
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(
        tf.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=HEADS,
            num_key_value_heads=1,
            **QUIET,
        )
    )
    before = {name: p for name, p in model.named_parameters()}
    modules = [type(m) for m in model.modules()]
    try:
        shard(model, sp=False)
    except ValueError as error:
        assert "num_key_value_heads=1 is not divisible by tp_size=2" in str(error)
    else:
        raise AssertionError("sharding LLaMA with 1 KV head over 2 ranks did not fail")
    assert dict(model.named_parameters()) == before
    assert [type(m) for m in model.modules()] == modules


@distributed(2)
def test_tp2_matches_single_process() -> None:
    @parameterize("family", list(FAMILIES))
    @parameterize("sp", [False, True])
    @parameterize("precision", ["fp32", "bf16"])
    def case(family: str, sp: bool, precision: str) -> None:
        check_forward_backward(family, sp, precision)

    case()
    for family in ("gpt2", "llama"):
        for sp in (False, True):
            check_training(family, sp)
    check_gpt2_outputs()
    check_communication()
    check_refused_before_any_change()
    check_sequence_not_divisible()
    check_deepcopy_under_sp()
    for sp in (False, True):
        check_custom_plan(sp)
        check_dropout_masks(sp)
        check_gradient_checkpointing(sp)


@distributed(4)
def test_tp4_matches_single_process() -> None:
    """tp 4: GPT-2 (4 heads -> 1 per rank; vocabulary 128 padded to 256 for 64 x 4)."""
    for sp in (False, True):
        check_forward_backward("gpt2", sp, "fp32")
    check_training("gpt2", sp=True)
