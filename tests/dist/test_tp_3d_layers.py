"""3D tensor-parallel layers vs the dense layers they stand for, on 8 gloo ranks (q = 2).

One spawned job (the cube's groups are built once) checks every layer: each rank builds the same
seeded dense layer and the 3D layer from it (or the 3D layer with its default initialisation,
which must equal the dense layer's), feeds its block of the same input, and compares

* the forward output with its block of the dense output,
* the input gradient with its block of the dense input gradient,
* every parameter gradient: this rank's block, on every replica, of the dense gradient (and, for
  the linear layers, the gradients gathered to dense with ``gather_3d_full``),
* ``full_state()`` with the dense ``state_dict()``, and a round trip through
  ``load_full_state``.

The losses and the accuracy are compared with the dense ones on the whole batch. Tolerances: fp32
on CPU; the only differences are the order of partial sums, hence 1e-5.

The communication check (bytes per training step of the MLP against the closed form of
:func:`~kolossos.nn.layer.parallel_3d.linear_3d`) runs in the same job: ``_check_mlp_comm``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import kolossos
from kolossos.nn.layer.parallel_3d import (
    Accuracy3D,
    Classifier3D,
    CrossEntropyLoss3D,
    Dropout3D,
    Embedding3D,
    Groups3D,
    LayerNorm3D,
    Linear3D,
    ParallelModule3D,
    PatchEmbedding3D,
    VocabParallelClassifier3D,
    VocabParallelCrossEntropyLoss3D,
    VocabParallelEmbedding3D,
    build_groups_3d,
    gather_3d_full,
    get_3d_spec,
    reduce_by_batch_3d,
    slice_3d_shard,
    split_batch_3d,
    split_tensor_3d,
)
from kolossos.nn.layer.shard_layout import get_shard_layout
from kolossos.testing import spawn
from kolossos.utils.profiling import CommCounter

TOL = {"rtol": 1e-5, "atol": 1e-5}
Q = 2
BATCH, HIDDEN = 16, 8  # BATCH divisible by q**2 (batch blocks), HIDDEN by q**2 (out_features)


def _replicas(param: torch.Tensor) -> int:
    """How many ranks of the tensor group hold each element of ``param``."""
    layout = get_shard_layout(param)
    assert layout is not None, "an unmarked parameter"
    return layout.replicas


def _randn(*shape: int, seed: int) -> torch.Tensor:
    """The same tensor on every rank, whatever the ranks' default generators did."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _block(full: torch.Tensor, groups: Groups3D) -> torch.Tensor:
    """This rank's activation block: rows by weight then input group, features by output."""
    return split_tensor_3d(split_batch_3d(full, groups), -1, groups.output)


def _check_param_grads(layer: ParallelModule3D, dense: nn.Module, case: str) -> None:
    """Every parameter's gradient is this rank's block of the dense gradient (replicas too)."""
    for name, param in layer.named_parameters():
        spec = get_3d_spec(param)
        assert spec is not None and param.grad is not None, f"{case} {name}"
        expected = layer._from_dense(name, dense.get_parameter(name).grad)
        torch.testing.assert_close(param.grad, slice_3d_shard(expected, spec), **TOL, msg=case)


def _check_state_round_trip(layer: ParallelModule3D, dense: nn.Module, case: str) -> None:
    """``full_state()`` is the dense state (exactly); a copy with other values loads it back."""
    state = layer.full_state()  # COLLECTIVE
    assert state.keys() == dense.state_dict().keys(), case
    for name, value in dense.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=f"{case} {name}")
    other = copy.deepcopy(layer)
    assert all(get_3d_spec(p) is not None for p in other.parameters()), case
    with torch.no_grad():
        for param in other.parameters():
            param.add_(1.0)
    other.load_full_state(dense.state_dict())
    for name, param in other.named_parameters():
        torch.testing.assert_close(param, layer.get_parameter(name), rtol=0, atol=0, msg=case)


def _run_linear(layer: nn.Module, dense: nn.Module, groups: Groups3D, seed: int) -> None:
    """Forward and backward of a layer taking a ``(batch, in)`` activation block."""
    assert isinstance(layer, ParallelModule3D)
    x_full = _randn(BATCH, dense.in_features, seed=seed).requires_grad_()
    y_dense = dense(x_full)
    g_full = _randn(*y_dense.shape, seed=seed + 1)
    (y_dense * g_full).sum().backward()
    x = _block(x_full.detach(), groups).requires_grad_()
    y = layer(x)
    out = layer.output_groups
    if isinstance(layer, Classifier3D):  # classes whole: rows only
        g_block, y_expected = split_batch_3d(g_full, out), split_batch_3d(y_dense, out)
    else:
        g_block, y_expected = _block(g_full, out), _block(y_dense, out)
    (y * g_block).sum().backward()
    case = type(layer).__name__
    torch.testing.assert_close(y, y_expected, **TOL, msg=case)
    assert x.grad is not None and x_full.grad is not None
    torch.testing.assert_close(x.grad, _block(x_full.grad, groups), **TOL, msg=case)
    _check_param_grads(layer, dense, case)
    _check_state_round_trip(layer, dense, case)


def _check_linear_layers(groups: Groups3D) -> None:
    """Linear3D (default init = the dense init, and from an nn.Linear), Classifier3D,
    VocabParallelClassifier3D; the documented weight shapes; gathered gradients."""
    torch.manual_seed(1)
    dense = nn.Linear(HIDDEN, 4 * HIDDEN)
    torch.manual_seed(1)
    fc1 = Linear3D(HIDDEN, 4 * HIDDEN, groups=groups)  # the same draws as `dense`
    assert fc1.weight.shape == (HIDDEN // Q, 4 * HIDDEN // Q**2)  # (in/q, out/q**2)
    assert fc1.bias is not None and fc1.bias.shape == (4 * HIDDEN // Q,)
    assert get_3d_spec(fc1.weight).replicas == 1  # type: ignore[union-attr]
    assert _replicas(fc1.bias) == Q**2
    _run_linear(fc1, dense, groups, seed=10)
    gathered = gather_3d_full(fc1.weight.grad, get_3d_spec(fc1.weight))  # type: ignore[arg-type]
    torch.testing.assert_close(fc1._to_dense("weight", gathered), dense.weight.grad, **TOL)

    dense2 = nn.Linear(4 * HIDDEN, HIDDEN, bias=False)
    fc2 = Linear3D.from_native_module(dense2, fc1.output_groups)
    assert fc2.groups.input is groups.output and fc2.output_groups.input is groups.input
    _run_linear(fc2, dense2, fc1.output_groups, seed=20)

    head_dense = nn.Linear(HIDDEN, 5)  # 5 classes: Classifier3D keeps them whole
    head = Classifier3D.from_native_module(head_dense, groups)
    assert head.weight.shape == (5, HIDDEN // Q)
    _run_linear(head, head_dense, groups, seed=30)

    vocab_dense = nn.Linear(HIDDEN, 12)
    vocab_head = VocabParallelClassifier3D.from_native_module(vocab_dense, groups)
    assert vocab_head.weight.shape == (12 // Q**2, HIDDEN // Q)
    _run_linear(vocab_head, vocab_dense, groups, seed=40)

    # a classifier tied to an embedding's table computes with the embedding's values
    emb = Embedding3D(12, HIDDEN, groups=groups)
    tied = Classifier3D(HIDDEN, 12, weight=emb.weight, bias=False, groups=groups)
    assert tied.weight is emb.weight and not tied.has_weight
    x_full = _randn(BATCH, HIDDEN, seed=45)
    expected = split_batch_3d(F.linear(x_full, emb.full_weight()), groups)
    torch.testing.assert_close(tied(_block(x_full, groups)), expected, **TOL)


def _check_layernorm(groups: Groups3D) -> None:
    dense = nn.LayerNorm(HIDDEN, eps=1e-5)
    with torch.no_grad():
        dense.weight.copy_(_randn(HIDDEN, seed=50))
        dense.bias.copy_(_randn(HIDDEN, seed=51))
    norm = LayerNorm3D.from_native_module(dense, groups)
    x_full = (_randn(BATCH, 3, HIDDEN, seed=52) * 3 + 1).requires_grad_()
    y_dense = dense(x_full)
    g_full = _randn(*y_dense.shape, seed=53)
    (y_dense * g_full).sum().backward()
    x = _block(x_full.detach(), groups).requires_grad_()
    y = norm(x)
    (y * _block(g_full, groups)).sum().backward()
    torch.testing.assert_close(y, _block(y_dense, groups), **TOL)
    assert x.grad is not None and x_full.grad is not None
    torch.testing.assert_close(x.grad, _block(x_full.grad, groups), **TOL)
    _check_param_grads(norm, dense, "LayerNorm3D")
    _check_state_round_trip(norm, dense, "LayerNorm3D")


def _check_embeddings(groups: Groups3D) -> None:
    ids = torch.randint(0, 16, (BATCH, 3), generator=torch.Generator().manual_seed(60))
    ids[0, 0] = 3  # the padding row is looked up at least once
    for cls in (Embedding3D, VocabParallelEmbedding3D):
        torch.manual_seed(61)
        dense = nn.Embedding(16, HIDDEN, padding_idx=3)
        torch.manual_seed(61)
        emb = cls(16, HIDDEN, padding_idx=3, groups=groups)  # default init = dense init
        y_dense = dense(ids)
        g_full = _randn(*y_dense.shape, seed=62)
        (y_dense * g_full).sum().backward()
        y = emb(ids)  # the whole batch in, this rank's block out
        (y * _block(g_full, groups)).sum().backward()
        case = cls.__name__
        torch.testing.assert_close(y, _block(y_dense, groups), **TOL, msg=case)
        _check_param_grads(emb, dense, case)
        _check_state_round_trip(emb, dense, case)


class _DensePatch(nn.Module):
    """The dense patch embedding :class:`PatchEmbedding3D` stands for."""

    def __init__(self, state: dict[str, torch.Tensor], patch: int) -> None:
        super().__init__()
        for name, value in state.items():
            self.register_parameter(name, nn.Parameter(value.clone()))
        self.patch = patch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.conv2d(x, self.weight, self.bias, stride=self.patch).flatten(2).transpose(1, 2)
        out = torch.cat((self.cls_token.expand(out.shape[0], -1, -1), out), dim=1)
        return out + self.pos_embed


def _check_patch_embedding(groups: Groups3D) -> None:
    patches = PatchEmbedding3D(4, 2, 3, HIDDEN, groups=groups)
    state = {
        "weight": _randn(HIDDEN, 3, 2, 2, seed=70),
        "bias": _randn(HIDDEN, seed=71),
        "cls_token": _randn(1, 1, HIDDEN, seed=72),
        "pos_embed": _randn(1, 5, HIDDEN, seed=73),
    }
    patches.load_full_state(state)
    dense = _DensePatch(state, 2)
    images = _randn(BATCH, 3, 4, 4, seed=74)
    y_dense = dense(images)
    g_full = _randn(*y_dense.shape, seed=75)
    (y_dense * g_full).sum().backward()
    y = patches(images)
    assert y.shape == (BATCH // Q**2, 5, HIDDEN // Q)
    (y * _block(g_full, groups)).sum().backward()
    torch.testing.assert_close(y, _block(y_dense, groups), **TOL)
    _check_param_grads(patches, dense, "PatchEmbedding3D")
    _check_state_round_trip(patches, dense, "PatchEmbedding3D")


def _check_losses_and_accuracy(groups: Groups3D) -> None:
    """Whole-batch mean losses (with ignored targets and label smoothing), their logits'
    gradients, and the accuracy count, against the dense ones."""
    targets = torch.randint(0, 12, (BATCH,), generator=torch.Generator().manual_seed(80))
    targets[1] = -100
    options = {"label_smoothing": 0.1}
    # classes whole (Classifier3D's logits: the same on the output group)
    logits_full = _randn(BATCH, 12, seed=81).requires_grad_()
    F.cross_entropy(logits_full, targets, **options).backward()
    logits = split_batch_3d(logits_full.detach(), groups).requires_grad_()
    loss = CrossEntropyLoss3D(groups=groups, **options)(logits, targets)
    loss.backward()
    expected = F.cross_entropy(logits_full.detach(), targets, **options)
    torch.testing.assert_close(loss, expected, **TOL)
    assert logits.grad is not None and logits_full.grad is not None
    torch.testing.assert_close(logits.grad, split_batch_3d(logits_full.grad, groups), **TOL)
    per_sample = CrossEntropyLoss3D(False, groups=groups)(logits, targets)
    dense_per_sample = F.cross_entropy(logits_full, targets, reduction="none")
    torch.testing.assert_close(per_sample, split_batch_3d(dense_per_sample, groups), **TOL)
    correct = Accuracy3D(groups=groups)(logits, targets)
    assert correct.item() == (logits_full.argmax(-1) == targets).sum().item()
    # classes split (VocabParallelClassifier3D's logits)
    logits_full.grad = None
    F.cross_entropy(logits_full, targets, **options).backward()
    block = _block(logits_full.detach(), groups).requires_grad_()
    vocab_loss = VocabParallelCrossEntropyLoss3D(groups=groups, **options)(block, targets)
    vocab_loss.backward()
    torch.testing.assert_close(vocab_loss, expected, **TOL)
    assert block.grad is not None
    torch.testing.assert_close(block.grad, _block(logits_full.grad, groups), **TOL)
    total = reduce_by_batch_3d(torch.ones(()), groups, reduce_mean=True)
    assert total.item() == 1.0


def _check_dropout(groups: Groups3D) -> None:
    """Independent masks on the 8 blocks; identical masks when re-run from the same state."""
    drop = Dropout3D(0.5, groups=groups)
    x = torch.ones(64)
    state = torch.get_rng_state()
    mask = drop(x) != 0
    torch.set_rng_state(state)
    assert torch.equal(drop(x) != 0, mask)
    masks = [torch.empty_like(mask) for _ in range(Q**3)]
    dist.all_gather(masks, mask, group=groups.tensor)
    assert len({tuple(m.tolist()) for m in masks}) == Q**3
    assert torch.equal(drop.eval()(x), x)


def _mlp_closed_form(batch: int, dim: int, q: int) -> tuple[int, float]:
    """Bytes per rank per training step of Linear3D(dim, 4 dim) -> GELU -> Linear3D(4 dim, dim)
    in fp32: ``(logical bytes, ring-model bytes sent)``.

    Each :func:`linear_3d` (``rows x in -> out``) moves, forward and backward, the gathered input
    and output gradient and the reduce-scattered output and input gradient (``rows/q`` rows of
    ``in/q`` or ``out/q`` features each), and the gathered weight and reduce-scattered weight
    gradient (``in/q x out/q``): ``2 (rows in + in out + rows out) / q**2`` elements, of which a
    ring sends ``(q-1)/q`` — the docs' ``6 (q-1) / q**3`` for square matrices. Each bias adds an
    all-reduce of ``out/q`` elements over the ``q**2`` ranks of the output x weight plane (sent:
    ``2 (q**2-1)/q**2`` of it).
    """
    logical, sent = 0, 0.0
    for n_in, n_out in ((dim, 4 * dim), (4 * dim, dim)):
        matmul = 2 * (batch * n_in + n_in * n_out + batch * n_out) // q**2
        bias = n_out // q
        logical += 4 * (matmul + bias)
        sent += 4 * (matmul * (q - 1) / q + bias * 2 * (q**2 - 1) / q**2)
    return logical, sent


def _check_mlp_comm(groups: Groups3D) -> dict[str, float]:
    """Bytes of one training step (forward + backward) of the MLP, counted by CommCounter,
    equal the closed form (logical bytes exactly; ring-model bytes sent within 10%)."""
    batch, dim = 16, 16
    fc1 = Linear3D(dim, 4 * dim, groups=groups)
    fc2 = Linear3D(4 * dim, dim, groups=fc1.output_groups)
    x = _block(_randn(batch, dim, seed=90), groups).requires_grad_()
    with CommCounter("ring") as comm:
        y = fc2(F.gelu(fc1(x)))
        y.square().sum().backward()
    logical, sent = _mlp_closed_form(batch, dim, Q)
    assert comm.bytes() == logical, (comm.summary(), logical)
    assert abs(comm.sent_bytes() - sent) <= 0.1 * sent, (comm.summary(), sent)
    # the kinds the algorithm prescribes: 2 all-gathers forward (X, A) and 1 backward (dY),
    # 1 reduce-scatter forward (Y) and 2 backward (dX, dA), 1 all-reduce per bias
    kinds = {k: comm.calls(k) for k in ("all_gather", "reduce_scatter", "all_reduce")}
    assert kinds == {"all_gather": 6, "reduce_scatter": 6, "all_reduce": 2}, kinds
    assert comm.calls() == 14
    return {"measured": comm.bytes(), "closed_form": logical, "sent": comm.sent_bytes()}


def _check_errors(groups: Groups3D) -> None:
    """Sizes the cube cannot split are refused before any collective, naming the value."""
    with pytest.raises(ValueError, match="in_features=5 must be a positive multiple of 2"):
        Linear3D(5, 8, groups=groups)
    with pytest.raises(ValueError, match="out_features=6 must be a positive multiple of 4"):
        Linear3D(4, 6, groups=groups)
    with pytest.raises(ValueError, match="normalized_shape=7"):
        LayerNorm3D(7, groups=groups)
    with pytest.raises(ValueError, match="num_embeddings=10 must be a positive multiple of 4"):
        VocabParallelEmbedding3D(10, 8, groups=groups)
    with pytest.raises(ValueError, match="num_classes=6"):
        VocabParallelClassifier3D(8, 6, groups=groups)
    with pytest.raises(ValueError, match="not divisible by q\\*\\*2=4"):
        split_batch_3d(torch.zeros(6, 4), groups)
    with pytest.raises(ValueError, match="does not match"):
        Linear3D(4, 8, groups=groups, weight=torch.zeros(4, 8))  # nn.Linear's layout is (8, 4)


def _all_layers(rank: int, world_size: int, port: int) -> dict[str, float]:
    kolossos.launch(
        config={}, rank=rank, world_size=world_size, host="localhost", port=port, verbose=False
    )
    groups = build_groups_3d()
    assert (groups.depth, groups.size) == (Q, Q**3)
    _check_linear_layers(groups)
    _check_layernorm(groups)
    _check_embeddings(groups)
    _check_patch_embedding(groups)
    _check_losses_and_accuracy(groups)
    _check_dropout(groups)
    _check_errors(groups)
    return _check_mlp_comm(groups)


@pytest.mark.dist
def test_tp_3d_layers_match_dense() -> None:
    """Every 3D layer, loss and metric equals its dense counterpart on 8 ranks, and the MLP's
    bytes per step equal the closed form."""
    results = spawn(_all_layers, Q**3)
    assert all(r == results[0] for r in results)  # the same traffic on every rank
