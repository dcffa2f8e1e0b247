"""``kolossos.shardformer.layer`` under Colossal-AI's names and keywords, on 2 gloo ranks.

The ideas of Colossal-AI's ``tests/test_shardformer/test_layer``: every layer built with
``from_native_module`` from a seeded dense layer and run on the same input gives the dense
output, input gradient and (gathered) weight gradients; under sequence parallelism each rank
feeds its sequence shard. Plus what the Colossal-AI keywords add: ``overlap`` (same numbers,
fewer stored activations), ``stream_chunk_num``, initializers on shards, the randomizer and
the dropout masks. Tolerances: fp32 on CPU, partial sums in another order, hence 1e-5.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from kolossos.nn.layer.parallel_1d import gather_tp_full, get_tp_spec, is_sequence_parallel
from kolossos.shardformer.layer import (
    DropoutForParallelInput,
    DropoutForReplicatedInput,
    Embedding1D,
    FusedLayerNorm,
    FusedLinear1D_Col,
    GPT2FusedLinearConv1D_Col,
    GPT2FusedLinearConv1D_Row,
    Linear1D_Col,
    Linear1D_Row,
    VocabParallelEmbedding1D,
    cross_entropy_1d,
)
from kolossos.shardformer.layer.qkv_fused_linear import (
    gather_fused_qkv_in_gpt2_style,
    split_fused_qkv_in_gpt2_style,
)
from kolossos.shardformer.layer.utils import (
    Randomizer,
    SeqParallelUtils,
    create_randomizer_with_offset,
)
from kolossos.testing import distributed
from kolossos.utils.profiling import CommCounter

TOL: dict[str, Any] = {"rtol": 1e-5, "atol": 1e-5}
HIDDEN, BATCH, SEQ = 8, 2, 4


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _world() -> list[dist.ProcessGroup]:
    """The world group in a one-element list (as Colossal-AI's sharder passes groups)."""
    assert dist.group.WORLD is not None
    return [dist.group.WORLD]


def _grad(t: torch.Tensor) -> torch.Tensor:
    assert t.grad is not None
    return t.grad


def _rank() -> int:
    return dist.get_rank()


def _shard(t: torch.Tensor, dim: int = 1) -> torch.Tensor:
    return t.chunk(dist.get_world_size(), dim=dim)[_rank()]


def _gathered(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _full_grad(param: torch.Tensor) -> torch.Tensor:
    assert param.grad is not None
    spec = get_tp_spec(param)
    return param.grad if spec is None else gather_tp_full(param.grad, spec)


def _run(layer: nn.Module, dense: nn.Module, x: torch.Tensor, x_tp: torch.Tensor) -> tuple:
    """Forward/backward both with ``sum()`` (as upstream's tests); returns the outputs and the
    input gradients."""
    x, x_tp = x.clone().requires_grad_(), x_tp.clone().requires_grad_()
    y, y_tp = dense(x), layer(x_tp)
    y.sum().backward()
    y_tp.sum().backward()
    return y, y_tp, x.grad, x_tp.grad


def _check_linear_col_row(seq_parallel: bool, overlap: bool) -> None:
    """Upstream's check_linear_1d_col/row and col_plus_row, with seq_parallel and overlap."""
    case = f"seq_parallel={seq_parallel} overlap={overlap}"
    torch.manual_seed(1)
    fc1, fc2 = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)
    col = Linear1D_Col.from_native_module(
        copy.deepcopy(fc1), None, gather_output=True, seq_parallel=seq_parallel, overlap=overlap
    )
    assert col.weight.shape == (2 * HIDDEN, HIDDEN) and col.seq_parallel is seq_parallel
    x = _randn(BATCH, SEQ, HIDDEN, seed=2)
    x_tp = _shard(x) if seq_parallel else x
    y, y_tp, gx, gx_tp = _run(col, fc1, x, x_tp)
    torch.testing.assert_close(y_tp, y, **TOL, msg=case)
    torch.testing.assert_close(gx_tp, _shard(gx) if seq_parallel else gx, **TOL, msg=case)
    torch.testing.assert_close(_full_grad(col.weight), fc1.weight.grad, **TOL, msg=case)
    torch.testing.assert_close(_full_grad(col.bias), fc1.bias.grad, **TOL, msg=case)

    fc1.zero_grad()
    fc2.zero_grad()
    col = Linear1D_Col.from_native_module(
        copy.deepcopy(fc1), _world(), seq_parallel=seq_parallel, overlap=overlap
    )
    row = Linear1D_Row.from_native_module(copy.deepcopy(fc2), None, seq_parallel=seq_parallel)
    y, y_tp, gx, gx_tp = _run(nn.Sequential(col, row), nn.Sequential(fc1, fc2), x, x_tp)
    torch.testing.assert_close(y_tp, _shard(y) if seq_parallel else y, **TOL, msg=case)
    torch.testing.assert_close(gx_tp, _shard(gx) if seq_parallel else gx, **TOL, msg=case)
    assert is_sequence_parallel(row.bias) is seq_parallel
    SeqParallelUtils.allreduce_partial_data_grad(dist.group.WORLD, model=row)
    for tp_layer, dense in ((col, fc1), (row, fc2)):
        for name, param in tp_layer.named_parameters():
            grad = dense.get_parameter(name).grad
            torch.testing.assert_close(_full_grad(param), grad, **TOL, msg=f"{case} {name}")

    # parallel_input=False: the row layer splits a replicated input itself.
    fc2.zero_grad()
    row = Linear1D_Row.from_native_module(copy.deepcopy(fc2), None, parallel_input=False)
    h = _randn(BATCH, SEQ, 4 * HIDDEN, seed=3)
    y, y_tp, gx, gx_tp = _run(row, fc2, h, h)
    torch.testing.assert_close(y_tp, y, **TOL)
    torch.testing.assert_close(gx_tp, gx, **TOL)
    torch.testing.assert_close(_full_grad(row.weight), fc2.weight.grad, **TOL)


def _check_gpt2_conv1d() -> None:
    """Upstream's test_gpt2_qkv_fused_linear_1d: fused q, k, v Conv1D (col) and c_proj (row)."""
    torch.manual_seed(4)
    c_attn, c_proj = Conv1D(3 * HIDDEN, HIDDEN), Conv1D(HIDDEN, HIDDEN)
    col = GPT2FusedLinearConv1D_Col.from_native_module(
        copy.deepcopy(c_attn), None, gather_output=True, n_fused=3
    )
    assert col.weight.shape == (HIDDEN, 3 * HIDDEN // 2) and col.n_fused == 3
    x = _randn(BATCH, SEQ, HIDDEN, seed=5)
    y, y_tp, gx, gx_tp = _run(col, c_attn, x, x)
    torch.testing.assert_close(y_tp, y, **TOL)  # gathered in the dense order [q | k | v]
    torch.testing.assert_close(gx_tp, gx, **TOL)
    target = split_fused_qkv_in_gpt2_style(_grad(c_attn.weight), 3, None, True)
    torch.testing.assert_close(col.weight.grad, target, **TOL)
    full = gather_fused_qkv_in_gpt2_style(col.weight.detach(), 3, None, is_transposed=True)
    torch.testing.assert_close(full, c_attn.weight.detach(), rtol=0, atol=0)
    bias = split_fused_qkv_in_gpt2_style(c_attn.bias.detach(), 3, _world(), True)
    torch.testing.assert_close(col.bias.detach(), bias, rtol=0, atol=0)

    # Sequence-parallel entry with overlap: the shard in, the local heads out.
    c_attn.zero_grad()
    col = GPT2FusedLinearConv1D_Col.from_native_module(
        copy.deepcopy(c_attn), None, seq_parallel=True, overlap=True
    )
    with CommCounter() as comm:
        y, y_tp, gx, gx_tp = _run(col, c_attn, x, _shard(x))
    # Only the input shard is kept for backward, which all-gathers it again (overlapped with
    # the input-gradient matmul) and reduce-scatters the input gradient.
    assert col(_shard(x).requires_grad_()).grad_fn.saved_tensors[0].shape == _shard(x).shape
    full_bytes = x.numel() * 4
    assert comm.calls("all_gather") == 2 and comm.bytes("all_gather") == 2 * full_bytes
    assert comm.calls("reduce_scatter") == 1 and comm.bytes("reduce_scatter") == full_bytes
    local = split_fused_qkv_in_gpt2_style(y.detach(), 3, None, is_transposed=True)
    torch.testing.assert_close(y_tp, local, **TOL)
    torch.testing.assert_close(gx_tp, _shard(gx), **TOL)
    target = split_fused_qkv_in_gpt2_style(_grad(c_attn.weight), 3, None, True)
    torch.testing.assert_close(col.weight.grad, target, **TOL)

    row = GPT2FusedLinearConv1D_Row.from_native_module(
        copy.deepcopy(c_proj), None, parallel_input=False
    )
    assert row.weight.shape == (HIDDEN // 2, HIDDEN)
    y, y_tp, gx, gx_tp = _run(row, c_proj, x, x)
    torch.testing.assert_close(y_tp, y, **TOL)
    torch.testing.assert_close(gx_tp, gx, **TOL)
    torch.testing.assert_close(row.weight.grad, _shard(_grad(c_proj.weight), 0), **TOL)
    with pytest.raises(TypeError, match="Conv1D"):
        GPT2FusedLinearConv1D_Row.from_native_module(nn.Linear(HIDDEN, HIDDEN), None)


def _check_fused_linear_and_chunks() -> None:
    """FusedLinear1D_Col over nn.Linear (n_fused positional, async_communication), and the
    row layer's inference-only stream_chunk_num."""
    torch.manual_seed(6)
    qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
    col = FusedLinear1D_Col.from_native_module(
        copy.deepcopy(qkv), None, 3, gather_output=True, async_communication=True
    )
    assert col.overlap and col.async_communication
    x = _randn(BATCH, SEQ, HIDDEN, seed=7)
    y, y_tp, gx, gx_tp = _run(col, qkv, x, x)
    torch.testing.assert_close(y_tp, y, **TOL)
    torch.testing.assert_close(gx_tp, gx, **TOL)
    torch.testing.assert_close(_full_grad(col.weight), qkv.weight.grad, **TOL)
    built = FusedLinear1D_Col(HIDDEN, 3 * HIDDEN, process_group=None)  # three blocks by default
    spec = get_tp_spec(built.weight)
    assert spec is not None and spec.fused_sections == (HIDDEN,) * 3

    # dtype / device: given weights are cast, as Colossal-AI's layers do.
    wide = Linear1D_Col.from_native_module(copy.deepcopy(qkv), None, dtype=torch.float64)
    assert wide.weight.dtype == wide.bias.dtype == torch.float64 and wide.weight.requires_grad
    with pytest.raises(ValueError, match="bias_ was given without weight"):
        Linear1D_Row(HIDDEN, HIDDEN, bias_=torch.zeros(HIDDEN))

    fc = nn.Linear(4 * HIDDEN, 3 * HIDDEN)
    row = Linear1D_Row.from_native_module(copy.deepcopy(fc), None, stream_chunk_num=2).eval()
    h = _randn(BATCH, SEQ, 4 * HIDDEN, seed=8)
    torch.testing.assert_close(row(_shard(h, -1)), fc(h), **TOL)
    with pytest.raises(RuntimeError, match="inference only"):
        row.train()(_shard(h, -1))


def _check_embeddings() -> None:
    """Upstream's test_vocab_parallel_embedding_1d and test_embedding (Colossal-AI's unpadded
    layout with make_vocab_size_divisible_by=1; scale_grad_by_freq on Embedding1D)."""
    torch.manual_seed(9)
    dense = nn.Embedding(16, HIDDEN, padding_idx=3)
    vocab = VocabParallelEmbedding1D.from_native_module(
        copy.deepcopy(dense), _world(), make_vocab_size_divisible_by=1
    )
    assert vocab.weight.shape == (8, HIDDEN)
    ids = torch.randint(0, 16, (BATCH, SEQ), generator=torch.Generator().manual_seed(10))
    out, out_tp = dense(ids), vocab(ids)
    torch.testing.assert_close(out_tp, out, **TOL)
    out.sum().backward(), out_tp.sum().backward()
    torch.testing.assert_close(_full_grad(vocab.weight), dense.weight.grad, **TOL)

    dense = nn.Embedding(16, HIDDEN, scale_grad_by_freq=True)
    emb = Embedding1D.from_native_module(copy.deepcopy(dense), None)
    assert emb.scale_grad_by_freq and emb.weight.shape == (16, HIDDEN // 2)
    out, out_tp = dense(ids), emb(ids)
    torch.testing.assert_close(out_tp, out, **TOL)
    (out * out).sum().backward(), (out_tp * out_tp).sum().backward()
    torch.testing.assert_close(_full_grad(emb.weight), dense.weight.grad, **TOL)
    with pytest.raises(NotImplementedError, match="scale_grad_by_freq"):
        VocabParallelEmbedding1D.from_native_module(copy.deepcopy(dense), None)


def _check_fused_layer_norm_sp() -> None:
    """Upstream's test_layernorm, plus the sequence-parallel mark: a LayerNorm on sequence shards
    has the dense gradients once SeqParallelUtils sums them."""
    torch.manual_seed(11)
    norm = nn.LayerNorm(HIDDEN)
    fused = FusedLayerNorm.from_native_module(
        copy.deepcopy(norm), sp_partial_derived=True, process_group=None
    )
    x = _randn(BATCH, SEQ, HIDDEN, seed=12)
    y, y_tp, _, _ = _run(fused, norm, x, _shard(x))
    torch.testing.assert_close(y_tp, _shard(y), **TOL)
    grads = [_grad(p) for p in fused.parameters()]
    SeqParallelUtils.allreduce_partial_data_grad(dist.group.WORLD, grads=grads)
    torch.testing.assert_close(fused.weight.grad, norm.weight.grad, **TOL)
    torch.testing.assert_close(fused.bias.grad, norm.bias.grad, **TOL)


@distributed(2)
def test_layers_equal_the_dense_ones() -> None:
    """Linear col/row (seq_parallel, overlap), GPT-2 Conv1D fused qkv col/row, fused nn.Linear,
    stream_chunk_num, vocabulary and column embeddings, FusedLayerNorm under SP."""
    for seq_parallel in (False, True):
        for overlap in (False, True):
            _check_linear_col_row(seq_parallel, overlap)
    _check_gpt2_conv1d()
    _check_fused_linear_and_chunks()
    _check_embeddings()
    _check_fused_layer_norm_sp()


def _check_cross_entropy() -> None:
    """Upstream's test_dist_crossentropy: cross_entropy_1d on each rank's vocabulary slice equals
    F.cross_entropy on the full logits, gradients included."""
    pred = _randn(BATCH, SEQ, 8, seed=13).requires_grad_()
    labels = torch.randint(8, (BATCH, SEQ), generator=torch.Generator().manual_seed(14))
    labels[0, -1] = -100
    loss = F.cross_entropy(pred.view(-1, 8), labels.view(-1))
    local = _shard(pred.detach(), -1).clone().requires_grad_()
    loss_tp = cross_entropy_1d(local, labels, ignore_index=-100)
    torch.testing.assert_close(loss_tp, loss, **TOL)
    loss.backward(), loss_tp.backward()
    torch.testing.assert_close(local.grad, _shard(_grad(pred), -1), **TOL)


def _check_dropout() -> None:
    """Upstream's test_dropout: different masks on the ranks for parallel input, the same mask
    for replicated input; from_native_module keeps p."""
    torch.manual_seed(15)  # the ranks' default generators agree: the premise
    parallel = DropoutForParallelInput.from_native_module(nn.Dropout(0.5), None)
    replicated = DropoutForReplicatedInput(0.5, False, dist.group.WORLD)
    assert parallel.p == 0.5 and not replicated.inplace
    x = torch.ones(64)
    par, rep = _gathered(parallel(x)), _gathered(replicated(x))
    assert not torch.equal(par[0], par[1])
    assert torch.equal(rep[0], rep[1]) and set(rep[0].unique().tolist()) == {0.0, 2.0}


def _check_initializers() -> None:
    """weight_initializer / bias_initializer fill the local shards with the full layer's fans:
    independent shards, a replicated bias equal on every rank, padding rows zero."""
    calls: list[tuple[tuple[int, ...], dict[str, int]]] = []

    def uniform(tensor: torch.Tensor, **fans: int) -> None:
        calls.append((tuple(tensor.shape), fans))
        tensor.uniform_(-1.0, 1.0)

    torch.manual_seed(16)
    col = Linear1D_Col(HIDDEN, 4 * HIDDEN, weight_initializer=uniform, bias_initializer=uniform)
    row = Linear1D_Row(4 * HIDDEN, HIDDEN, weight_initializer=uniform, bias_initializer=uniform)
    assert calls == [
        ((2 * HIDDEN, HIDDEN), {"fan_in": HIDDEN, "fan_out": 4 * HIDDEN}),
        ((2 * HIDDEN,), {"fan_in": HIDDEN}),
        ((HIDDEN, 2 * HIDDEN), {"fan_in": 4 * HIDDEN, "fan_out": HIDDEN}),
        ((HIDDEN,), {"fan_in": 4 * HIDDEN}),
    ]
    for sharded in (col.weight, col.bias, row.weight):
        pieces = _gathered(sharded.detach())
        assert not torch.equal(pieces[0], pieces[1])
    replicated = _gathered(row.bias.detach())
    assert torch.equal(replicated[0], replicated[1])
    vocab = VocabParallelEmbedding1D(
        100, HIDDEN, padding_idx=0, weight_initializer=uniform, make_vocab_size_divisible_by=64
    )
    full = vocab.full_weight()
    assert vocab.weight.shape == (64, HIDDEN) and full.shape == (100, HIDDEN)
    assert torch.all(full[0] == 0) and torch.all(full[1:] != 0)
    if _rank() == 1:  # rows 100..127 are vocabulary padding
        assert torch.all(vocab.weight[100 - 64 :] == 0)
    with pytest.raises(ValueError, match="weight_initializer only applies"):
        Linear1D_Col.from_native_module(nn.Linear(HIDDEN, HIDDEN), None, weight_initializer=uniform)


def _check_randomizer() -> None:
    """The randomizer index is checked and synchronised across ranks; offsets by rank give
    different streams, offsets by index alone the same one."""
    Randomizer.reset_index()
    assert Randomizer.is_randomizer_index_synchronized()
    if _rank() == 1:
        Randomizer.increment_index()
    assert not Randomizer.is_randomizer_index_synchronized()
    with pytest.raises(RuntimeError, match="synchronize_index"):
        create_randomizer_with_offset(7)
    Randomizer.synchronize_index()
    assert Randomizer.index() == 1
    per_rank = create_randomizer_with_offset(7)
    same = create_randomizer_with_offset(7, offset_by_rank=False)
    assert Randomizer.index() == 3
    with per_rank.fork_rng(enable_cpu=True):
        a = torch.rand(8)
    with same.fork_rng(enable_cpu=True):
        b = torch.rand(8)
    assert not torch.equal(*_gathered(a)) and torch.equal(*_gathered(b))
    Randomizer.reset_index()


@distributed(2)
def test_loss_dropout_initializers_and_randomizer() -> None:
    """cross_entropy_1d vs F.cross_entropy, dropout masks, initializers on shards, the
    randomizer index across ranks."""
    _check_cross_entropy()
    _check_dropout()
    _check_initializers()
    _check_randomizer()
