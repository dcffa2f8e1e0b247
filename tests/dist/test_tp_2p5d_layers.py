"""2.5D (Tesseract) tensor-parallel layers vs the dense layers, on 8 gloo ranks (q = 2, d = 2).

One spawned job runs every check (8-rank spawns are expensive on a 2-core machine). Every rank
builds the dense layer and the 2.5D layer from the same seed, runs both on the same global batch
(the 2.5D layer on this rank's block) and compares: the output block, the input gradient block,
and every parameter gradient gathered to the dense shape. Tolerances: fp32 on CPU; the only
differences are the order of the partial sums, hence 1e-5.

Communication (this file also holds the traffic check, sharing the spawn): one training step
(forward + backward, the input needs no gradient) of the documented MLP ``256 -> 1024 -> 256``
on a batch of 16 is counted with ``CommCounter`` and compared with the closed form of this
implementation. Per ``Linear2p5D(K, N)``, with ``m = B / (d q)`` rows per rank, fp32:

* forward SUMMA (``q`` steps): broadcast the ``m x K/q`` input block along the row and the
  ``K/q x N/q`` weight block along the column, each step;
* weight gradient (``q`` steps): broadcast the input block along the row, reduce the
  ``K/q x N/q`` partial product along the column; then all-reduce it over the depth group;
* input gradient (``q`` steps, second layer only): broadcast the weight block along the column,
  reduce the ``m x K/q`` partial product along the row;
* bias gradient: all-reduce ``N/q`` over the ``d q`` batch blocks (``xz``).

So per layer: broadcast ``2 m K + K N / q (+ K N / q)``, reduce ``K N / q (+ m K)``, all-reduce
``K N / q^2`` (depth) ``+ N / q`` (xz) elements; what a rank sends under the ring model is
``(q-1)/q`` of the broadcasts and reduces and ``2(g-1)/g`` of an all-reduce over ``g`` ranks —
the docs' ``3 (q-1)/q`` activation and weight blocks per matmul plus the depth reduction
(``O(3(q-1)(d+1)/dq)``, F0:6515-6686).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import kolossos
from kolossos.nn.layer.parallel_2p5d import (
    Accuracy2p5D,
    Classifier2p5D,
    CrossEntropyLoss2p5D,
    Dropout2p5D,
    Embedding2p5D,
    Groups2p5D,
    LayerNorm2p5D,
    Linear2p5D,
    ParallelModule2p5D,
    PatchEmbedding2p5D,
    VocabParallelClassifier2p5D,
    VocabParallelCrossEntropyLoss2p5D,
    VocabParallelEmbedding2p5D,
    get_2p5d_spec,
    new_groups_2p5d,
    split_batch_2p5d,
    split_tensor_2p5d,
)
from kolossos.nn.layer.shard_layout import get_shard_layout
from kolossos.testing import spawn
from kolossos.utils.profiling import CommCounter

pytestmark = pytest.mark.dist

TOL = {"rtol": 1e-5, "atol": 1e-5}
B, S, H = 8, 3, 8  # batch divisible by d*q = 4; hidden divisible by q*q = 4


def _replicas(param: torch.Tensor) -> int:
    """How many ranks of the tensor group hold each element of ``param``."""
    layout = get_shard_layout(param)
    assert layout is not None, "an unmarked parameter"
    return layout.replicas


def _randn(*shape: int, seed: int) -> torch.Tensor:
    """The same tensor on every rank."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _grads_match(layer: ParallelModule2p5D, dense: nn.Module, case: str) -> None:
    """Every parameter gradient of ``layer``, gathered, equals the dense layer's."""
    dense_grads = {n: p.grad for n, p in dense.named_parameters()}
    owned = layer.owned_parameters()
    assert set(owned) == set(dense_grads), case
    for name, param in owned.items():
        spec = get_2p5d_spec(param)
        assert spec is not None and param.grad is not None, f"{case}: {name}"
        torch.testing.assert_close(spec.gather(param.grad), dense_grads[name], **TOL, msg=case)


def _check_init_and_state(g: Groups2p5D) -> None:
    """Same seed -> the dense layer's full matrix; full_state / load_full_state / state_dict
    round trips keep the shards and their marks."""
    torch.manual_seed(5)
    dense = nn.Linear(H, 4 * H)
    torch.manual_seed(5)
    layer = Linear2p5D(H, 4 * H, groups=g)
    assert tuple(layer.weight.shape) == (H // 2, 2 * H)  # (in/q, out/q), as Colossal-AI
    state = layer.full_state()
    for name, value in dense.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0)
    torch.manual_seed(6)
    other = Linear2p5D(H, 4 * H, groups=g)
    assert not torch.equal(other.weight, layer.weight)
    other.load_full_state(state)
    assert torch.equal(other.weight, layer.weight) and torch.equal(other.bias, layer.bias)
    clone = copy.deepcopy(layer)
    assert get_2p5d_spec(clone.weight) is get_2p5d_spec(layer.weight)
    clone.load_state_dict(layer.state_dict(), assign=True)
    assert get_2p5d_spec(clone.weight) is not None
    with pytest.raises(KeyError, match="missing"):
        other.load_full_state({"weight": state["weight"]})
    # norm marking: sum over the tensor group of |g|^2 / replicas counts each element once
    for param in layer.parameters():
        param.grad = param.detach().clone()
    local = sum(p.grad.pow(2).sum() / _replicas(p) for p in layer.parameters())
    total = torch.tensor([float(local)], dtype=torch.float64)
    dist.all_reduce(total, group=g.tensor)
    dense_sq = sum(float(v.double().pow(2).sum()) for v in dense.state_dict().values())
    assert abs(total.item() - dense_sq) < 1e-6 * dense_sq
    assert get_2p5d_spec(layer.weight).replicas == 2 and get_2p5d_spec(layer.bias).replicas == 4


def _check_mlp(g: Groups2p5D) -> None:
    """Linear -> GELU -> Linear -> LayerNorm, inputs with an extra sequence dimension."""
    torch.manual_seed(1)
    dense = nn.Sequential(nn.Linear(H, 4 * H), nn.GELU(), nn.Linear(4 * H, H), nn.LayerNorm(H))
    with torch.no_grad():  # a LayerNorm with non-trivial affine parameters
        dense[3].weight.copy_(_randn(H, seed=7))
        dense[3].bias.copy_(_randn(H, seed=8))
    torch.manual_seed(1)
    fc1, fc2 = Linear2p5D(H, 4 * H, groups=g), Linear2p5D(4 * H, H, groups=g)
    norm = LayerNorm2p5D(H, groups=g)
    norm.load_full_state(dense[3].state_dict())
    tp = nn.Sequential(fc1, nn.GELU(), fc2, norm)
    x = _randn(B, S, H, seed=3)
    cot = _randn(B, S, H, seed=4)
    x_dense = x.clone().requires_grad_()
    (dense(x_dense) * cot).sum().backward()
    x_tp = split_tensor_2p5d(x, g).clone().requires_grad_()
    y_tp = tp(x_tp)
    (y_tp * split_tensor_2p5d(cot, g)).sum().backward()
    with torch.no_grad():
        torch.testing.assert_close(y_tp, split_tensor_2p5d(dense(x), g), **TOL)
    torch.testing.assert_close(x_tp.grad, split_tensor_2p5d(x_dense.grad, g), **TOL)
    for layer, ref in ((fc1, dense[0]), (fc2, dense[2]), (norm, dense[3])):
        _grads_match(layer, ref, type(layer).__name__)
    skip = Linear2p5D(H, H, skip_bias_add=True, groups=g)
    out, bias = skip(split_tensor_2p5d(x, g))
    assert bias is not None and torch.equal(bias, skip.bias)
    assert out.shape == (B // 4, S, H // 2)


def _check_embeddings(g: Groups2p5D) -> None:
    ids = torch.randint(0, 16, (B, S), generator=torch.Generator().manual_seed(11))
    ids[0, 0] = 3  # the padding row is looked up
    for cls in (Embedding2p5D, VocabParallelEmbedding2p5D):
        torch.manual_seed(2)
        dense = nn.Embedding(16, H, padding_idx=3)
        torch.manual_seed(2)
        layer = cls(16, H, padding_idx=3, groups=g)
        for name, value in layer.full_state().items():
            torch.testing.assert_close(value, dense.state_dict()[name], rtol=0, atol=0)
        y_dense = dense(ids)
        y_tp = layer(ids)
        cot = _randn(*y_dense.shape, seed=12)
        (y_dense * cot).sum().backward()
        (y_tp * split_tensor_2p5d(cot, g)).sum().backward()
        torch.testing.assert_close(y_tp, split_tensor_2p5d(y_dense.detach(), g), **TOL)
        _grads_match(layer, dense, cls.__name__)


def _dense_patch(state: dict[str, torch.Tensor], images: torch.Tensor, patch: int) -> torch.Tensor:
    out = F.conv2d(images, state["weight"], state["bias"], stride=patch)
    out = out.flatten(2).transpose(1, 2)
    cls = state["cls_token"].expand(images.shape[0], -1, -1)
    return torch.cat((cls, out), dim=1) + state["pos_embed"]


def _check_patch_embedding(g: Groups2p5D) -> None:
    torch.manual_seed(4)
    layer = PatchEmbedding2p5D(4, 2, 3, H, groups=g)
    state = layer.full_state()
    state["cls_token"] = _randn(1, 1, H, seed=21)
    state["pos_embed"] = _randn(1, 5, H, seed=22)
    layer.load_full_state(state)
    params = {k: v.clone().requires_grad_() for k, v in state.items()}
    images = _randn(B, 3, 4, 4, seed=23)
    y_dense = _dense_patch(params, images, 2)
    y_tp = layer(images)
    cot = _randn(*y_dense.shape, seed=24)
    (y_dense * cot).sum().backward()
    (y_tp * split_tensor_2p5d(cot, g)).sum().backward()
    torch.testing.assert_close(y_tp, split_tensor_2p5d(y_dense.detach(), g), **TOL)
    for name, param in layer.named_parameters():
        spec = get_2p5d_spec(param)
        assert spec is not None and param.grad is not None
        torch.testing.assert_close(spec.gather(param.grad), params[name].grad, **TOL, msg=name)


def _check_classifiers_and_losses(g: Groups2p5D) -> None:
    """Classifier -> CrossEntropyLoss2p5D and VocabParallelClassifier ->
    VocabParallelCrossEntropyLoss2p5D equal F.cross_entropy (ignore_index, label smoothing),
    and Accuracy2p5D the dense count."""
    classes = 8
    x = _randn(B, H, seed=31)
    targets = torch.randint(0, classes, (B,), generator=torch.Generator().manual_seed(32))
    targets[1] = -100
    for cls, loss_cls, vocab in (
        (Classifier2p5D, CrossEntropyLoss2p5D, False),
        (VocabParallelClassifier2p5D, VocabParallelCrossEntropyLoss2p5D, True),
    ):
        torch.manual_seed(3)
        dense = nn.Linear(H, classes)
        torch.manual_seed(3)
        layer = cls(H, classes, groups=g)
        for smoothing in (0.0, 0.1):
            dense.zero_grad()
            layer.zero_grad()
            x_dense = x.clone().requires_grad_()
            x_tp = split_tensor_2p5d(x, g).clone().requires_grad_()
            ref = F.cross_entropy(dense(x_dense), targets, label_smoothing=smoothing)
            logits = layer(x_tp)
            loss = loss_cls(groups=g, label_smoothing=smoothing)(logits, targets)
            ref.backward()
            loss.backward()
            case = f"{cls.__name__} smoothing={smoothing}"
            torch.testing.assert_close(loss, ref.detach(), **TOL, msg=case)
            torch.testing.assert_close(x_tp.grad, split_tensor_2p5d(x_dense.grad, g), **TOL)
            _grads_match(layer, dense, case)
            with torch.no_grad():
                want = dense(x)
                want = split_tensor_2p5d(want, g) if vocab else split_batch_2p5d(want, g)
                torch.testing.assert_close(layer(split_tensor_2p5d(x, g)), want, **TOL, msg=case)
        if not vocab:
            valid = targets.clamp(min=0)
            dense_correct = int((dense(x).argmax(-1) == valid).sum())
            correct = Accuracy2p5D(g)(layer(split_tensor_2p5d(x, g)), valid)
            assert int(correct) == dense_correct
    # the sum reduction and a tied classifier
    torch.manual_seed(3)
    emb = Embedding2p5D(classes, H, groups=g)
    head = Classifier2p5D(H, classes, weight=emb.weight, groups=g)
    assert head.weight is emb.weight and set(head.full_state()) == {"bias"}
    total = CrossEntropyLoss2p5D("sum", groups=g)(head(split_tensor_2p5d(x, g)), targets)
    full = {"weight": emb.full_state()["weight"], **head.full_state()}
    ref = F.cross_entropy(F.linear(x, full["weight"], full["bias"]), targets, reduction="sum")
    torch.testing.assert_close(total, ref, **TOL)


def _check_dropout(g: Groups2p5D) -> None:
    drop = Dropout2p5D(0.5, groups=g)
    x = torch.ones(64, 16)
    mask = (drop(x) != 0).to(torch.int64)
    masks = [torch.empty_like(mask) for _ in range(dist.get_world_size(g.tensor))]
    dist.all_gather(masks, mask, group=g.tensor)
    assert len({tuple(m.flatten().tolist()) for m in masks}) == len(masks)  # independent
    drop.eval()
    assert torch.equal(drop(x), x)


def _mlp_step_bytes(g: Groups2p5D) -> dict[str, float]:
    """Measured vs closed form, one step of the documented MLP (see the module docstring)."""
    torch.manual_seed(0)
    fc1, fc2 = Linear2p5D(256, 1024, groups=g), Linear2p5D(1024, 256, groups=g)
    x = split_tensor_2p5d(_randn(16, 256, seed=1), g)
    with CommCounter() as comm:
        y = fc2(F.gelu(fc1(x)))
        y.square().sum().backward()
    q, d, elt = g.tesseract_dim, g.tesseract_dep, 4
    m = 16 // (d * q)
    expected = {"broadcast": 0.0, "reduce": 0.0, "all_reduce": 0.0}
    sent = 0.0
    for k, n, input_grad in ((256, 1024, False), (1024, 256, True)):
        bcast = 2 * m * k + k * n / q + (k * n / q if input_grad else 0)
        red = k * n / q + (m * k if input_grad else 0)
        dep, xz = k * n / q**2, n / q
        expected["broadcast"] += bcast * elt
        expected["reduce"] += red * elt
        expected["all_reduce"] += (dep + xz) * elt
        sent += (bcast + red) * elt * (q - 1) / q
        sent += dep * elt * 2 * (d - 1) / d + xz * elt * 2 * (d * q - 1) / (d * q)
    measured = {kind: float(comm.bytes(kind)) for kind in expected}
    assert comm.bytes() == sum(measured.values()), comm.summary()  # nothing else was sent
    for kind, value in expected.items():
        assert abs(measured[kind] - value) <= 0.1 * value, (kind, measured, expected)
    assert abs(comm.sent_bytes() - sent) <= 0.1 * sent, (comm.sent_bytes(), sent)
    return {"measured": float(comm.bytes()), "expected": sum(expected.values()),
            "sent": comm.sent_bytes(), "sent_expected": sent}  # fmt: skip


def _run(rank: int, world_size: int, port: int) -> dict[str, float]:
    kolossos.launch(config={}, rank=rank, world_size=world_size, host="localhost", port=port)
    g = new_groups_2p5d(depth=2)
    assert (g.tesseract_dim, g.tesseract_dep) == (2, 2)
    assert dist.get_rank() == g.col_index + 2 * g.row_index + 4 * g.depth_index
    _check_init_and_state(g)
    _check_mlp(g)
    _check_embeddings(g)
    _check_patch_embedding(g)
    _check_classifiers_and_losses(g)
    _check_dropout(g)
    return _mlp_step_bytes(g)


def test_tp_2p5d_layers_match_dense() -> None:
    """Every 2.5D layer, loss and metric equals its dense counterpart on 8 ranks; the MLP's
    bytes per step match the closed form (printed for the docs' table)."""
    results = spawn(_run, 8)
    print("2.5D MLP step bytes (rank 0):", results[0])
    assert all(r == results[0] for r in results)  # every rank moves the same volume
