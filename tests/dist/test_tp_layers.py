"""1D tensor-parallel layers vs the dense layers they were sliced from, on 2 and 4 gloo ranks.

Every rank builds the same seeded dense layer, a tensor-parallel copy with ``from_native_module``,
and runs both on the same input: forward outputs, input gradients and (gathered) weight gradients
must agree. Under sequence parallelism each rank feeds its sequence shard and compares with the
matching slice of the dense result. Tolerances: fp32 on CPU; the only differences are the order
of the partial sums (all-reduce of per-rank matmul pieces), hence 1e-5.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.pytorch_utils import Conv1D

from kolossos.nn.layer.parallel_1d import (
    DropoutForParallelInput,
    DropoutForReplicatedInput,
    Embedding1D,
    FusedLinear1D_Col,
    Linear1D_Col,
    Linear1D_Row,
    TPShardSpec,
    VocabParallelEmbedding1D,
    VocabParallelLMHead1D,
    all_reduce_sequence_parallel_grads,
    copy_to_tp,
    default_rng_in_sync,
    gather_seq_reduce_scatter_grad,
    gather_tp_full,
    get_tp_rng_tracker,
    get_tp_spec,
    is_sequence_parallel,
    mark_sequence_parallel,
    set_tp_spec,
    slice_tp_shard,
)
from kolossos.nn.layer.parallel_1d._comm import all_gather_flat
from kolossos.testing import distributed, parameterize
from kolossos.utils.profiling import CommCounter

TOL = {"rtol": 1e-5, "atol": 1e-5}
HIDDEN, BATCH, SEQ = 16, 2, 8  # SEQ divisible by 2 and 4 (sequence parallelism)
SP_MODES = (None, "split_gather")


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    """The same tensor on every rank, whatever the ranks' default generators did before."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


_TP_GROUP: list[dist.ProcessGroup] = []  # a subgroup under test, else the world


def _ids(vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _world() -> tuple[dist.ProcessGroup, int, int]:
    """The tensor-parallel group under test, this rank's rank in it, and its size."""
    group = _TP_GROUP[0] if _TP_GROUP else dist.group.WORLD
    assert group is not None
    return group, dist.get_rank(group), dist.get_world_size(group)


def _check_subgroups() -> None:
    """On 4 ranks: two tensor-parallel groups of 2 ({0, 1}, {2, 3}) side by side."""
    if dist.get_world_size() != 4:
        return
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    _TP_GROUP.append(groups[dist.get_rank() // 2])
    try:
        _check_mlp(layout="conv1d", bias=True)
        _check_vocab_embedding(vocab_divisor=(31, 1), padding_idx=30)
        _check_lm_head_loss(vocab_divisor=(37, 1), reduction="mean")
        _check_dropout()
    finally:
        _TP_GROUP.clear()


def _seq_shard(t: torch.Tensor, sp: str | None, dim: int = 1) -> torch.Tensor:
    _, rank, world = _world()
    return t.chunk(world, dim=dim)[rank] if sp else t


def _assert_grad(param: torch.Tensor, dense_grad: torch.Tensor | None, name: str) -> None:
    """A (possibly sharded) parameter's gradient equals the dense one."""
    assert param.grad is not None and dense_grad is not None, name
    spec = get_tp_spec(param)
    full = param.grad if spec is None else gather_tp_full(param.grad, spec)
    torch.testing.assert_close(full, dense_grad, **TOL, msg=name)


def _dense_linear(layout: str, d_in: int, d_out: int, bias: bool, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if layout == "conv1d":
        return Conv1D(d_out, d_in)  # weight (in, out), always with a bias
    return nn.Linear(d_in, d_out, bias=bias)


@parameterize("layout", ["linear", "conv1d"])
@parameterize("sp", SP_MODES)
@parameterize("bias", [True, False])
def _check_mlp(layout: str, sp: str | None, bias: bool) -> None:
    if layout == "conv1d" and not bias:
        return  # transformers' Conv1D always has a bias
    group, _, _ = _world()
    fc1 = _dense_linear(layout, HIDDEN, 4 * HIDDEN, bias, seed=1)
    fc2 = _dense_linear(layout, 4 * HIDDEN, HIDDEN, bias, seed=2)
    col = Linear1D_Col.from_native_module(fc1, group, seq_parallel_mode=sp)
    row = Linear1D_Row.from_native_module(fc2, group, seq_parallel_mode=sp)
    x, g = _randn(BATCH, SEQ, HIDDEN, seed=3), _randn(BATCH, SEQ, HIDDEN, seed=4)
    x_dense = x.clone().requires_grad_()
    y_dense = fc2(F.gelu(fc1(x_dense)))
    (y_dense * g).sum().backward()
    x_tp = _seq_shard(x, sp).clone().requires_grad_()
    with CommCounter() as comm:
        y_tp = row(F.gelu(col(x_tp)))
        (y_tp * _seq_shard(g, sp)).sum().backward()

    case = f"layout={layout} sp={sp} bias={bias}"
    # Megatron's volumes: 2 all-reduces of the activations per step, or under sequence
    # parallelism 2 all-gathers + 2 reduce-scatters of the same size, and nothing else.
    full_bytes = BATCH * SEQ * HIDDEN * 4
    expected = {"all_gather": 2, "reduce_scatter": 2} if sp else {"all_reduce": 2}
    assert {kind: comm.calls(kind) for kind in expected} == expected, case
    assert comm.calls() == sum(expected.values()), case
    assert all(comm.bytes(kind) == 2 * full_bytes for kind in expected), case
    torch.testing.assert_close(y_tp, _seq_shard(y_dense, sp), **TOL, msg=case)
    torch.testing.assert_close(x_tp.grad, _seq_shard(x_dense.grad, sp), **TOL, msg=case)
    if sp and bias:
        assert is_sequence_parallel(row.bias) and not is_sequence_parallel(col.bias)
        assert all_reduce_sequence_parallel_grads(row, group) == 1
    for tp_layer, dense in ((col, fc1), (row, fc2)):
        for name, param in tp_layer.named_parameters():
            _assert_grad(param, dense.get_parameter(name).grad, f"{case} {name}")
        torch.testing.assert_close(tp_layer.full_weight(), dense.weight.detach(), rtol=0, atol=0)


def _check_sequence_parallel_block() -> None:
    """LayerNorm on the sequence shard -> column -> row (reduce-scatter) -> residual: the
    LayerNorm gradients, summed over the group, equal the dense ones."""
    group, _, _ = _world()
    sp = "split_gather"
    torch.manual_seed(29)
    norm, fc1, fc2 = nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, 32), nn.Linear(32, HIDDEN)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5), norm.bias.uniform_(-0.5, 0.5)
    tp_norm = copy.deepcopy(norm)
    for param in tp_norm.parameters():
        mark_sequence_parallel(param)
    col, row = (Linear1D_Col, fc1), (Linear1D_Row, fc2)
    block = nn.ModuleList(
        [tp_norm] + [c.from_native_module(m, group, seq_parallel_mode=sp) for c, m in (col, row)]
    )
    x, g = _randn(BATCH, SEQ, HIDDEN, seed=30), _randn(BATCH, SEQ, HIDDEN, seed=31)
    x_dense = x.clone().requires_grad_()
    ((x_dense + fc2(F.gelu(fc1(norm(x_dense))))) * g).sum().backward()
    x_tp = _seq_shard(x, sp).clone().requires_grad_()
    y_tp = x_tp + block[2](F.gelu(block[1](block[0](x_tp))))
    (y_tp * _seq_shard(g, sp)).sum().backward()
    assert all_reduce_sequence_parallel_grads(block, group) == 3  # LayerNorm weight, bias; row bias
    torch.testing.assert_close(x_tp.grad, _seq_shard(x_dense.grad, sp), **TOL)
    for tp_layer, dense in zip(block, (norm, fc1, fc2), strict=True):
        for name, param in tp_layer.named_parameters():
            _assert_grad(param, dense.get_parameter(name).grad, f"sp block {name}")


@parameterize("layout", ["linear", "conv1d"])
def _check_standalone_linear(layout: str) -> None:
    """Column with a gathered output; row with a replicated input it splits itself."""
    group, _, _ = _world()
    for build, options in (
        (Linear1D_Col, {"gather_output": True}),
        (Linear1D_Row, {"parallel_input": False}),
    ):
        dense = _dense_linear(layout, HIDDEN, 2 * HIDDEN, True, seed=5)
        layer = build.from_native_module(copy.deepcopy(dense), group, **options)
        x, g = _randn(BATCH, HIDDEN, seed=6), _randn(BATCH, 2 * HIDDEN, seed=7)
        x_dense, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
        (dense(x_dense) * g).sum().backward()
        y_tp = layer(x_tp)
        (y_tp * g).sum().backward()
        case = f"{build.__name__} {layout}"
        torch.testing.assert_close(y_tp, dense(x), **TOL, msg=case)
        torch.testing.assert_close(x_tp.grad, x_dense.grad, **TOL, msg=case)
        for name, param in layer.named_parameters():
            _assert_grad(param, dense.get_parameter(name).grad, f"{case} {name}")


@parameterize("sp", SP_MODES)
def _check_shared_input_comm(sp: str | None) -> None:
    """Two columns reading one input gathered (or copied) once by the caller: input_comm=False."""
    group, _, _ = _world()
    up, gate = (_dense_linear("linear", HIDDEN, 2 * HIDDEN, True, seed=s) for s in (24, 25))
    down = _dense_linear("linear", 2 * HIDDEN, HIDDEN, True, seed=26)
    cols = [Linear1D_Col.from_native_module(m, group, input_comm=False) for m in (up, gate)]
    row = Linear1D_Row.from_native_module(down, group, seq_parallel_mode=sp)
    x, g = _randn(BATCH, SEQ, HIDDEN, seed=27), _randn(BATCH, SEQ, HIDDEN, seed=28)
    x_dense = x.clone().requires_grad_()
    (down(up(x_dense) * gate(x_dense)) * g).sum().backward()
    x_tp = _seq_shard(x, sp).clone().requires_grad_()
    full = gather_seq_reduce_scatter_grad(x_tp, group) if sp else copy_to_tp(x_tp, group)
    y_tp = row(cols[0](full) * cols[1](full))
    (y_tp * _seq_shard(g, sp)).sum().backward()
    torch.testing.assert_close(x_tp.grad, _seq_shard(x_dense.grad, sp), **TOL)
    for layer, dense in zip((*cols, row), (up, gate, down), strict=True):
        _assert_grad(layer.weight, dense.weight.grad, f"input_comm=False sp={sp}")
    with pytest.raises(ValueError, match="input_comm=False"):
        Linear1D_Col.from_native_module(
            up, group, input_comm=False, seq_parallel_mode="split_gather"
        )


@parameterize("layout", ["linear", "conv1d"])
@parameterize("sp", SP_MODES)
def _check_fused_qkv(layout: str, sp: str | None) -> None:
    """GPT-2's c_attn: each rank computes its heads of q, k and v."""
    group, rank, world = _world()
    dense = _dense_linear(layout, HIDDEN, 3 * HIDDEN, True, seed=8)
    local = FusedLinear1D_Col.from_native_module(dense, group, seq_parallel_mode=sp)
    full = FusedLinear1D_Col.from_native_module(dense, group, gather_output=True)
    x = _randn(BATCH, SEQ, HIDDEN, seed=9)
    x_dense, x_tp = x.clone().requires_grad_(), _seq_shard(x, sp).clone().requires_grad_()
    y_dense = dense(x_dense)
    q, k, v = y_dense.split(HIDDEN, dim=-1)
    mine = torch.cat([t.chunk(world, dim=-1)[rank] for t in (q, k, v)], dim=-1)
    y_tp = local(x_tp)
    torch.testing.assert_close(y_tp, mine, **TOL)
    torch.testing.assert_close(full(x), y_dense, **TOL)
    g = _randn(BATCH, SEQ, 3 * HIDDEN, seed=10)
    (y_dense * g).sum().backward()
    g_q, g_k, g_v = g.split(HIDDEN, dim=-1)
    g_mine = torch.cat([t.chunk(world, dim=-1)[rank] for t in (g_q, g_k, g_v)], dim=-1)
    (y_tp * g_mine).sum().backward()
    torch.testing.assert_close(x_tp.grad, _seq_shard(x_dense.grad, sp), **TOL)
    for name, param in local.named_parameters():
        _assert_grad(param, dense.get_parameter(name).grad, f"fused {layout} {sp} {name}")


@parameterize("vocab_divisor", [(31, 1), (40, 64), (64, 1)])
@parameterize("padding_idx", [None, 30])
@parameterize("sp", SP_MODES)
def _check_vocab_embedding(
    vocab_divisor: tuple[int, int], padding_idx: int | None, sp: str | None
) -> None:
    vocab, divisor = vocab_divisor
    group, _, world = _world()
    torch.manual_seed(11)
    dense = nn.Embedding(vocab, HIDDEN, padding_idx=padding_idx)
    layer = VocabParallelEmbedding1D.from_native_module(
        dense, group, make_vocab_size_divisible_by=divisor, seq_parallel_mode=sp
    )
    assert layer.num_embeddings_padded % (divisor * world) == 0
    assert get_tp_spec(layer.weight).padded == layer.num_embeddings_padded - vocab  # type: ignore[union-attr]
    ids = _ids(vocab, seed=12)
    ids[0, :3] = torch.tensor([0, vocab - 1, 30])
    g = _randn(BATCH, SEQ, HIDDEN, seed=13)
    y_dense, y_tp = dense(ids), layer(ids)
    (y_dense * g).sum().backward()
    (y_tp * _seq_shard(g, sp)).sum().backward()
    case = f"vocab={vocab} divisor={divisor} padding_idx={padding_idx} sp={sp}"
    torch.testing.assert_close(y_tp, _seq_shard(y_dense, sp), **TOL, msg=case)
    _assert_grad(layer.weight, dense.weight.grad, case)
    torch.testing.assert_close(layer.full_weight(), dense.weight.detach(), rtol=0, atol=0)


def _check_embedding_1d() -> None:
    group, _, _ = _world()
    torch.manual_seed(14)
    dense = nn.Embedding(20, HIDDEN, padding_idx=0)
    layer = Embedding1D.from_native_module(dense, group)
    ids = _ids(20, seed=15)
    g, y_tp = _randn(BATCH, SEQ, HIDDEN, seed=16), layer(ids)
    (dense(ids) * g).sum().backward()
    (y_tp * g).sum().backward()
    torch.testing.assert_close(y_tp, dense(ids), **TOL)
    _assert_grad(layer.weight, dense.weight.grad, "Embedding1D")


def _check_spec_round_trip() -> None:
    group, rank, world = _world()
    full = _randn(3 * 4 * world, 5, seed=17)
    specs = [
        TPShardSpec(dim=0, full_shape=tuple(full.shape), group=group),
        TPShardSpec(
            dim=0, full_shape=tuple(full.shape), fused_sections=(4 * world,) * 3, group=group
        ),
        TPShardSpec(dim=0, full_shape=(full.shape[0] - 1, 5), padded=1, group=group),
        TPShardSpec(dim=1, full_shape=(5, full.shape[0]), group=group),
    ]
    sources = [full, full, full[:-1], full.t().contiguous()]
    for spec, source in zip(specs, sources, strict=True):
        shard = slice_tp_shard(source, spec, rank)
        assert tuple(shard.shape) == spec.shard_shape()
        torch.testing.assert_close(gather_tp_full(shard, spec), source, rtol=0, atol=0)
    fused = slice_tp_shard(full, specs[1], rank)  # rank r holds its piece of every block
    blocks = full.split(4 * world)
    torch.testing.assert_close(fused, torch.cat([b.chunk(world)[rank] for b in blocks]))
    padded = slice_tp_shard(full[:-1], specs[2], world - 1)
    assert torch.equal(padded[-1], torch.zeros(5))  # the padding row is zeros, on the last rank
    with pytest.raises(ValueError, match="not divisible"):
        TPShardSpec(dim=0, full_shape=(4 * world + 1, 5), group=group)
    with pytest.raises(ValueError, match="fused_sections"):
        TPShardSpec(
            dim=0, full_shape=(4 * world, 5), fused_sections=(1, 4 * world - 1), group=group
        )
    with pytest.raises(ValueError, match="shard shape"):
        set_tp_spec(nn.Parameter(full), specs[0])


def _check_copies_keep_marks() -> None:
    """deepcopy and load_state_dict(assign=True) make new Parameter objects (torch drops tensor
    attributes on both): the layers keep their shard specs and sequence-parallel marks."""
    group, _, _ = _world()
    model = nn.Sequential(
        Linear1D_Col(HIDDEN, HIDDEN, process_group=group),
        Linear1D_Row(HIDDEN, HIDDEN, process_group=group, seq_parallel_mode="split_gather"),
        DropoutForParallelInput(0.1, process_group=group),
    )
    clone = copy.deepcopy(model)
    assert clone[0].weight is not model[0].weight and clone[2].process_group is group
    state = {name: t + 1 for name, t in model.state_dict().items()}
    model.load_state_dict(state, assign=True)
    for copied in (clone, model):
        assert get_tp_spec(copied[0].weight) is not None and get_tp_spec(copied[1].weight)
        assert is_sequence_parallel(copied[1].bias) and get_tp_spec(copied[1].bias) is None
    assert torch.equal(model[0].weight, state["0.weight"])


def _check_errors() -> None:
    group, _, world = _world()
    with pytest.raises(NotImplementedError, match="all_to_all"):
        Linear1D_Col(HIDDEN, HIDDEN, process_group=group, seq_parallel_mode="all_to_all")
    with pytest.raises(NotImplementedError, match="ring"):  # the linear layers only
        VocabParallelEmbedding1D(8, HIDDEN, process_group=group, seq_parallel_mode="ring")
    with pytest.raises(TypeError, match="Conv1D"):
        Linear1D_Row.from_native_module(nn.Embedding(4, 4), group)
    with pytest.raises(NotImplementedError, match="max_norm"):
        VocabParallelEmbedding1D.from_native_module(nn.Embedding(8, 4, max_norm=1.0), group)
    row = Linear1D_Row(4 * world, HIDDEN, process_group=group, seq_parallel_mode="split_gather")
    with pytest.raises(ValueError, match="not divisible by the tensor-parallel size"):
        row(torch.randn(1, world + 1, 4))  # the sequence does not split over the ranks


@pytest.mark.parametrize("world_size", [2, 4])
@distributed()
def test_linear_embedding_and_specs(world_size: int) -> None:
    """Column/row MLP (nn.Linear and Conv1D, with and without sequence parallelism), standalone
    column/row, fused qkv, vocabulary-parallel and dimension-split embeddings with padding, shard
    spec round trips and argument errors."""
    assert dist.get_world_size() == world_size
    _check_mlp()
    _check_sequence_parallel_block()
    _check_standalone_linear()
    _check_shared_input_comm()
    _check_fused_qkv()
    _check_vocab_embedding()
    _check_embedding_1d()
    _check_spec_round_trip()
    _check_copies_keep_marks()
    _check_errors()


@parameterize("vocab_divisor", [(37, 1), (48, 64)])
@parameterize("smoothing", [0.0, 0.1])
@parameterize("reduction", ["mean", "sum", "none"])
@parameterize("sp", SP_MODES)
def _check_lm_head_loss(
    vocab_divisor: tuple[int, int], smoothing: float, reduction: str, sp: str | None
) -> None:
    vocab, divisor = vocab_divisor
    group, _, _ = _world()
    torch.manual_seed(18)
    dense = nn.Linear(HIDDEN, vocab, bias=False)
    head = VocabParallelLMHead1D.from_native_module(
        dense, group, make_vocab_size_divisible_by=divisor, seq_parallel_mode=sp
    )
    h = _randn(BATCH, SEQ, HIDDEN, seed=19)
    labels = _ids(vocab, seed=20)
    labels[0, :3] = torch.tensor([-100, vocab - 1, 0])
    h_dense, h_tp = h.clone().requires_grad_(), _seq_shard(h, sp).clone().requires_grad_()
    logits = dense(h_dense)
    loss_dense = F.cross_entropy(
        logits.view(-1, vocab),
        labels.view(-1),
        ignore_index=-100,
        label_smoothing=smoothing,
        reduction=reduction,
    )
    weights = _randn(*loss_dense.shape, seed=21)  # a non-uniform upstream gradient for "none"
    with CommCounter() as comm:
        local_logits = head(h_tp)
        loss_tp = head.loss(local_logits, labels, label_smoothing=smoothing, reduction=reduction)
        (loss_tp.reshape(-1) * weights.reshape(-1)).sum().backward()
    assert local_logits.shape[-1] == head.out_features_padded // head.tp_size
    case = f"vocab={vocab} smoothing={smoothing} reduction={reduction} sp={sp}"
    torch.testing.assert_close(loss_tp.view(-1), loss_dense.view(-1), **TOL, msg=case)
    (loss_dense * weights).sum().backward()
    # No logits ever cross ranks: the loss costs 2 all-reduces of a few floats per token; the
    # only activation traffic is the hidden states' (gradient all-reduce, or SP gather/scatter).
    tokens, hidden_bytes = BATCH * SEQ, BATCH * SEQ * HIDDEN * 4
    loss_bytes = tokens * 4 * (1 + (3 if smoothing else 2))
    if sp:
        assert comm.bytes("all_gather") == comm.bytes("reduce_scatter") == hidden_bytes, case
        assert comm.bytes("all_reduce") == loss_bytes, case
    else:
        assert comm.calls() == 3 and comm.bytes("all_reduce") == loss_bytes + hidden_bytes, case
    torch.testing.assert_close(h_tp.grad, _seq_shard(h_dense.grad, sp), **TOL, msg=case)
    _assert_grad(head.weight, dense.weight.grad, case)


def _check_lm_head_gathered() -> None:
    group, _, _ = _world()
    torch.manual_seed(22)
    dense = nn.Linear(HIDDEN, 37, bias=True)
    head = VocabParallelLMHead1D.from_native_module(
        dense, group, gather_output=True, make_vocab_size_divisible_by=1
    )
    h = _randn(BATCH, SEQ, HIDDEN, seed=23)
    torch.testing.assert_close(head(h), dense(h), **TOL)
    torch.testing.assert_close(head.full_state()["bias"], dense.bias.detach(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="gather_output=False"):
        head.loss(head(h), torch.zeros(BATCH, SEQ, dtype=torch.long))


def _gathered(t: torch.Tensor) -> list[torch.Tensor]:
    group, _, world = _world()
    flat = torch.empty(world * t.numel())
    all_gather_flat(flat, t.contiguous().view(-1), group)
    return list(flat.view(world, *t.shape).unbind(0))


def _check_dropout() -> None:
    """Replicated activations: the same mask on every rank; sharded: different masks. The default
    generator advances by one draw only, eval mode is the identity, and activation checkpointing
    recomputes the same masks."""
    group, _, _ = _world()
    torch.manual_seed(0)  # default generators in sync across the group: the premise
    replicated = DropoutForReplicatedInput(0.5, process_group=group)
    sharded = DropoutForParallelInput.from_native_module(nn.Dropout(0.5), group)
    x, state = torch.ones(256), torch.get_rng_state()
    rep = [replicated(x) for _ in range(2)]
    par = sharded(x)
    after = torch.get_rng_state()
    torch.set_rng_state(state)
    for _ in range(3):  # the one draw each dropout call takes from the default generator
        torch.randint(0, 2**63 - 1, (1,))
    assert torch.equal(torch.get_rng_state(), after)
    assert not torch.equal(rep[0], rep[1])  # the state advances between calls
    for out in rep:
        masks = _gathered(out)
        assert all(torch.equal(m, masks[0]) for m in masks)
        assert set(out.unique().tolist()) == {0.0, 2.0}
    masks = _gathered(par)
    assert all(not torch.equal(masks[0], m) for m in masks[1:])
    with get_tp_rng_tracker().fork(sharded.rng_state_name):  # re-entering the active stream
        assert set(sharded(x).unique().tolist()) == {0.0, 2.0}
        nested = replicated(x)  # a replicated stream inside a rank-dependent block: still equal
    assert all(torch.equal(m, _gathered(nested)[0]) for m in _gathered(nested))
    sharded.eval()
    assert torch.equal(sharded(x), x)
    sharded.train()

    # Activation checkpointing re-runs the forward: the recomputed masks equal the first ones.
    w = torch.ones(256, requires_grad=True)
    results = []
    for use_checkpoint in (True, False):
        torch.manual_seed(5)
        out = (
            checkpoint(lambda t: sharded(t * w), x, use_reentrant=False)
            if use_checkpoint
            else sharded(x * w)
        )
        (out * torch.arange(256.0)).sum().backward()
        results.append((out.detach(), w.grad.clone()))
        w.grad = None
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)

    assert default_rng_in_sync(group)
    torch.manual_seed(dist.get_rank())  # out of sync now
    assert not default_rng_in_sync(group)


@pytest.mark.parametrize("world_size", [2, 4])
@distributed()
def test_lm_head_cross_entropy_and_dropout(world_size: int) -> None:
    """Vocabulary-parallel LM head + cross-entropy vs F.cross_entropy on the full logits
    (ignore_index, label smoothing, every reduction, vocabulary padding, sequence parallelism);
    the gathered head; dropout masks replicated vs sharded."""
    assert dist.get_world_size() == world_size
    _check_lm_head_loss()
    _check_lm_head_gathered()
    _check_dropout()
    _check_subgroups()
