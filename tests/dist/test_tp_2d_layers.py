"""2D (SUMMA) tensor-parallel layers vs the dense layers they are cut from, on a 2 x 2 grid of
4 gloo ranks.

Every rank builds the dense layer and the 2D layer after the same seed (so the 2D layer's
blocks are cut from the same full matrices), feeds its block of the same input, and compares:
forward output with its block of the dense output, input gradient with its block of the dense
input gradient, and every parameter gradient gathered to full size with the dense one. fp32 on
CPU: the only differences are the order of partial sums, hence 1e-5.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kolossos.hybrid.grad_norm import tp_global_norm
from kolossos.nn.layer.parallel_1d.random import get_tp_rng_tracker
from kolossos.nn.layer.parallel_2d import (
    Accuracy2D,
    Classifier2D,
    CrossEntropyLoss2D,
    Dropout2D,
    Embedding2D,
    Groups2D,
    LayerNorm2D,
    Linear2D,
    ParallelModule2D,
    PatchEmbedding2D,
    VocabParallelClassifier2D,
    VocabParallelCrossEntropyLoss2D,
    VocabParallelEmbedding2D,
    gather_2d_full,
    get_2d_spec,
    is_2d_sharded,
    reduce_by_batch_2d,
    split_batch_2d,
    summa_ab,
    summa_abt,
    summa_atb,
)
from kolossos.testing import distributed

pytestmark = pytest.mark.dist

TOL = {"rtol": 1e-5, "atol": 1e-5}
Q = 2


def _randn(*shape: int, seed: int) -> torch.Tensor:
    """The same tensor on every rank."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _grid() -> Groups2D:
    """Rows {0, 1}, {2, 3}; columns {0, 2}, {1, 3} (as the legacy launch builds them)."""
    rows = [dist.new_group([r * Q + c for c in range(Q)]) for r in range(Q)]
    cols = [dist.new_group([r * Q + c for r in range(Q)]) for c in range(Q)]
    rank = dist.get_rank()
    groups = Groups2D(row=rows[rank // Q], col=cols[rank % Q])
    assert (groups.row_index, groups.col_index) == (rank // Q, rank % Q)
    return groups


def _block(t: torch.Tensor, g: Groups2D) -> torch.Tensor:
    """Batch block ``i``, feature block ``j``: the docs' input partition."""
    return t.chunk(g.q, 0)[g.row_index].chunk(g.q, -1)[g.col_index].contiguous()


def _rows(t: torch.Tensor, g: Groups2D) -> torch.Tensor:
    return t.chunk(g.q, 0)[g.row_index]


def _full_grad(param: torch.Tensor) -> torch.Tensor:
    assert param.grad is not None
    spec = get_2d_spec(param)
    return param.grad if spec is None else gather_2d_full(param.grad, spec)


def _check_params(layer: ParallelModule2D, dense: nn.Module, case: str) -> None:
    """Same full values and gradients as the dense module's parameters of the same names."""
    dense_params = dict(dense.named_parameters())
    state = layer.full_state()
    assert set(state) == set(dense_params), case
    for name, param in layer.named_parameters():
        torch.testing.assert_close(state[name], dense_params[name].detach(), **TOL, msg=case)
        grad = dense_params[name].grad
        assert grad is not None, f"{case}: {name}"
        torch.testing.assert_close(_full_grad(param), grad, **TOL, msg=f"{case}: {name}")


def _run(
    layer: nn.Module, dense: nn.Module, x: torch.Tensor, x_block: torch.Tensor, out_block: object
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward both, backward ``sum(out * g)``; returns (2D output, its expected block)."""
    y_dense = dense(x)
    g = _randn(*y_dense.shape, seed=99)
    (y_dense * g).sum().backward()
    y = layer(x_block)
    assert callable(out_block)
    (y * out_block(g)).sum().backward()
    return y, out_block(y_dense.detach())


def _check_linear(g: Groups2D) -> None:
    for bias in (True, False):
        torch.manual_seed(1)
        dense = nn.Linear(8, 16, bias=bias)
        torch.manual_seed(1)
        layer = Linear2D(8, 16, bias, groups=g)
        assert layer.weight.shape == (4, 8) and (not bias or layer.bias.shape == (4,))
        x = _randn(4, 3, 8, seed=2)
        x_dense, x_block = x.clone().requires_grad_(), _block(x, g).requires_grad_()
        y, expected = _run(layer, dense, x_dense, x_block, lambda t: _block(t, g))
        torch.testing.assert_close(y, expected, **TOL)
        torch.testing.assert_close(x_block.grad, _block(x_dense.grad, g), **TOL)
        _check_params(layer, dense, f"Linear2D bias={bias}")
    state = nn.Linear(8, 16).state_dict()
    skip = Linear2D(8, 16, skip_bias_add=True, groups=g)
    skip.load_full_state(state)
    with_bias = Linear2D(8, 16, groups=g)
    with_bias.load_full_state(state)
    out, bias_block = skip(_block(x, g))
    assert bias_block.shape == (8,)  # this column's [out/q] bias block
    torch.testing.assert_close(out + bias_block, with_bias(_block(x, g)), **TOL)


def _check_classifiers(g: Groups2D) -> None:
    torch.manual_seed(3)
    dense = nn.Linear(8, 6)
    torch.manual_seed(3)
    head = Classifier2D(8, 6, groups=g)
    assert head.weight.shape == (6, 2) and head.bias.shape == (6,) and not is_2d_sharded(head.bias)
    x = _randn(4, 8, seed=4)
    x_dense, x_block = x.clone().requires_grad_(), _block(x, g).requires_grad_()
    y, expected = _run(head, dense, x_dense, x_block, lambda t: _rows(t, g))
    torch.testing.assert_close(y, expected, **TOL)
    torch.testing.assert_close(x_block.grad, _block(x_dense.grad, g), **TOL)
    _check_params(head, dense, "Classifier2D")

    torch.manual_seed(5)
    dense = nn.Linear(8, 12)
    torch.manual_seed(5)
    vocab_head = VocabParallelClassifier2D(8, 12, groups=g)
    assert vocab_head.weight.shape == (6, 4) and vocab_head.bias.shape == (3,)
    x_dense, x_block = x.clone().requires_grad_(), _block(x, g).requires_grad_()
    y, expected = _run(vocab_head, dense, x_dense, x_block, lambda t: _block(t, g))
    torch.testing.assert_close(y, expected, **TOL)
    torch.testing.assert_close(x_block.grad, _block(x_dense.grad, g), **TOL)
    _check_params(vocab_head, dense, "VocabParallelClassifier2D")


def _check_tied_heads(g: Groups2D) -> None:
    """A classifier sharing an embedding's weight computes ``x @ Eᵀ`` (same block layouts)."""
    x = _randn(4, 8, seed=40)
    for emb_cls, head_cls, out_block in (
        (Embedding2D, Classifier2D, lambda t: _rows(t, g)),
        (VocabParallelEmbedding2D, VocabParallelClassifier2D, lambda t: _block(t, g)),
    ):
        emb = emb_cls(12, 8, groups=g)
        head = head_cls(8, 12, emb.weight, bias=False, groups=g)
        assert head.weight is emb.weight
        full = emb.full_state()["weight"]
        torch.testing.assert_close(head(_block(x, g)), out_block(x @ full.t()), **TOL)


def _check_summa_atb(g: Groups2D) -> None:
    """``C = Aᵀ B`` and its two gradients (the product the others use in backward)."""
    a, b = _randn(6, 4, seed=6).requires_grad_(), _randn(6, 8, seed=7).requires_grad_()
    a_block, b_block = (
        _block(a.detach(), g).requires_grad_(),
        _block(b.detach(), g).requires_grad_(),
    )
    c = summa_atb(a_block, b_block, g)
    dense = a.t() @ b
    grad = _randn(4, 8, seed=8)
    (dense * grad).sum().backward()
    (c * _block(grad, g)).sum().backward()
    torch.testing.assert_close(c, _block(dense.detach(), g), **TOL)
    torch.testing.assert_close(a_block.grad, _block(a.grad, g), **TOL)
    torch.testing.assert_close(b_block.grad, _block(b.grad, g), **TOL)
    # the other two products in the forward direction, against plain matmuls
    w = _randn(4, 8, seed=9)
    torch.testing.assert_close(summa_ab(_block(a.detach(), g), _block(w, g), g), _block(a @ w, g))
    torch.testing.assert_close(
        summa_abt(_block(b.detach(), g), _block(w, g), g), _block(b @ w.t(), g), **TOL
    )


def _check_layer_norm(g: Groups2D) -> None:
    dense = nn.LayerNorm(16, eps=1e-6)
    with torch.no_grad():
        dense.weight.copy_(_randn(16, seed=10))
        dense.bias.copy_(_randn(16, seed=11))
    norm = LayerNorm2D(16, eps=1e-6, groups=g)
    assert norm.weight.shape == (4,)
    norm.load_full_state(dense.state_dict())
    x = 3.0 * _randn(4, 3, 16, seed=12) + 1.0
    x_dense, x_block = x.clone().requires_grad_(), _block(x, g).requires_grad_()
    y, expected = _run(norm, dense, x_dense, x_block, lambda t: _block(t, g))
    torch.testing.assert_close(y, expected, **TOL)
    torch.testing.assert_close(x_block.grad, _block(x_dense.grad, g), **TOL)
    _check_params(norm, dense, "LayerNorm2D")


def _check_embeddings(g: Groups2D) -> None:
    ids = torch.randint(0, 12, (4, 5), generator=torch.Generator().manual_seed(13))
    ids[0, 0] = 3  # the padding row is looked up
    for cls, dim in ((Embedding2D, 8), (VocabParallelEmbedding2D, 8)):
        torch.manual_seed(14)
        dense = nn.Embedding(12, dim, padding_idx=3)
        torch.manual_seed(14)
        layer = cls(12, dim, 3, groups=g)
        y, expected = _run(layer, dense, ids, ids, lambda t: _block(t, g))
        torch.testing.assert_close(y, expected, **TOL)
        _check_params(layer, dense, cls.__name__)
    assert layer.weight.shape == (6, 4)


class _DensePatch(nn.Module):
    """The dense patch embedding the 2D one is cut from (ViT's)."""

    def __init__(self, conv: nn.Conv2d, tokens: int, embed: int) -> None:
        super().__init__()
        self.weight, self.bias = conv.weight, conv.bias
        self.cls_token = nn.Parameter(_randn(1, 1, embed, seed=15))
        self.pos_embed = nn.Parameter(_randn(1, tokens, embed, seed=16))
        self.stride = conv.stride

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        out = (
            F.conv2d(images, self.weight, self.bias, stride=self.stride).flatten(2).transpose(1, 2)
        )
        out = torch.cat((self.cls_token.expand(out.shape[0], -1, -1), out), dim=1)
        return out + self.pos_embed


def _check_patch_embedding(g: Groups2D) -> None:
    torch.manual_seed(17)
    conv = nn.Conv2d(3, 8, 4, stride=4)
    torch.manual_seed(17)
    patch = PatchEmbedding2D(8, 4, 3, 8, groups=g)
    dense = _DensePatch(conv, patch.num_patches + 1, 8)
    patch.load_full_state({k: v.detach() for k, v in dense.state_dict().items()})
    images = _randn(4, 3, 8, 8, seed=18)
    y, expected = _run(patch, dense, images, images, lambda t: _block(t, g))
    assert y.shape == (2, 5, 4)
    torch.testing.assert_close(y, expected, **TOL)
    _check_params(patch, dense, "PatchEmbedding2D")


@distributed(4)
def test_tp_2d_layers_match_dense() -> None:
    """Every layer's forward, input gradient and parameter gradients equal the dense layer's."""
    g = _grid()
    _check_linear(g)
    _check_classifiers(g)
    _check_tied_heads(g)
    _check_summa_atb(g)
    _check_layer_norm(g)
    _check_embeddings(g)
    _check_patch_embedding(g)


def _check_losses(g: Groups2D) -> None:
    targets = torch.randint(0, 6, (8,), generator=torch.Generator().manual_seed(20))
    targets[1] = -100
    logits = _randn(8, 6, seed=21)
    weight = torch.rand(6, generator=torch.Generator().manual_seed(22)) + 0.5
    cases = [({}, {}), ({"label_smoothing": 0.1}, {}), ({"weight": weight}, {})]
    for kwargs, _ in cases:
        dense_logits = logits.clone().requires_grad_()
        dense_loss = F.cross_entropy(dense_logits, targets, **kwargs)
        dense_loss.backward()
        local = _rows(logits, g).clone().requires_grad_()
        loss = CrossEntropyLoss2D(groups=g, **kwargs)(local, targets)
        loss.backward()
        torch.testing.assert_close(loss, dense_loss, **TOL, msg=str(kwargs))
        torch.testing.assert_close(local.grad, _rows(dense_logits.grad, g), **TOL)
        per_sample = CrossEntropyLoss2D(False, groups=g, **kwargs)(local.detach(), targets)
        dense_none = F.cross_entropy(logits, targets, reduction="none", **kwargs)
        torch.testing.assert_close(per_sample, _rows(dense_none, g), **TOL)
    for smoothing in (0.0, 0.1):
        dense_logits = logits.clone().requires_grad_()
        dense_loss = F.cross_entropy(dense_logits, targets, label_smoothing=smoothing)
        dense_loss.backward()
        local = _block(logits, g).requires_grad_()
        criterion = VocabParallelCrossEntropyLoss2D(groups=g, label_smoothing=smoothing)
        loss = criterion(local, targets)
        loss.backward()
        torch.testing.assert_close(loss, dense_loss, **TOL)
        torch.testing.assert_close(local.grad, _block(dense_logits.grad, g), **TOL)
    correct = Accuracy2D(groups=g)(_rows(logits, g), targets)
    assert correct.item() == int((logits.argmax(-1) == targets).sum())
    total = reduce_by_batch_2d(torch.tensor(float(g.row_index + 1)), g, reduce_mean=True)
    assert total.item() == pytest.approx(sum(range(1, Q + 1)) / Q)


def _mlp(g: Groups2D) -> tuple[nn.Sequential, nn.Sequential]:
    torch.manual_seed(30)
    dense = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.LayerNorm(8))
    torch.manual_seed(31)  # other weights: the dense state must be loaded to match
    tp = nn.Sequential(
        Linear2D(8, 16, groups=g), nn.GELU(), Linear2D(16, 8, groups=g), LayerNorm2D(8, groups=g)
    )
    return dense, tp


def _check_state_round_trip(g: Groups2D) -> None:
    """dense → 2D → dense, the marks surviving deepcopy and ``load_state_dict(assign=True)``,
    and the gradient norm counting each block once."""
    dense, tp = _mlp(g)
    for d_layer, t_layer in zip(dense, tp, strict=True):
        if isinstance(t_layer, ParallelModule2D):
            t_layer.load_full_state(d_layer.state_dict())
    for d_layer, t_layer in zip(dense, tp, strict=True):
        if isinstance(t_layer, ParallelModule2D):
            state = t_layer.full_state()
            for key, value in d_layer.state_dict().items():
                torch.testing.assert_close(state[key], value, rtol=0, atol=0)
    clone = copy.deepcopy(tp)
    assert all(is_2d_sharded(p) for p in clone.parameters())
    tp.load_state_dict(clone.state_dict(), assign=True)
    assert all(is_2d_sharded(p) for p in tp.parameters())
    x = _randn(4, 8, seed=32)
    dense(x).square().sum().backward()
    tp(_block(x, g)).square().sum().backward()
    pieces = [(p.grad, is_2d_sharded(p)) for p in tp.parameters()]
    norm = tp_global_norm(pieces, 2.0, dist.group.WORLD)
    dense_norm = math.sqrt(sum(float(p.grad.square().sum()) for p in dense.parameters()))
    assert norm.item() == pytest.approx(dense_norm, rel=1e-5)


def _check_dropout(g: Groups2D) -> None:
    drop = Dropout2D(0.5, groups=g)
    x = torch.ones(64)
    state = torch.get_rng_state()
    first = drop(x)
    torch.set_rng_state(state)
    again = drop(x)
    torch.testing.assert_close(first, again, rtol=0, atol=0)  # reproducible (checkpointing)
    masks = [torch.empty_like(first) for _ in range(dist.get_world_size())]
    dist.all_gather(masks, first)
    assert all(not torch.equal(masks[0], m) for m in masks[1:])  # independent per rank
    assert torch.equal(drop.eval()(x), x)
    entered: list[bool] = []

    class _Context:
        def __enter__(self) -> None:
            entered.append(True)

        def __exit__(self, *args: object) -> None:
            return None

    Dropout2D(0.1, groups=g, rng_context=_Context)(x)
    assert entered == [True]
    assert drop.rng_state_name in get_tp_rng_tracker()


@distributed(4)
def test_tp_2d_losses_state_dropout() -> None:
    """Losses and accuracy equal the dense ones; dense state dicts round-trip; dropout masks."""
    g = _grid()
    _check_losses(g)
    _check_state_round_trip(g)
    _check_dropout(g)
    ids = torch.arange(8)
    assert torch.equal(split_batch_2d(ids, g), ids.chunk(Q)[g.row_index])
