"""Routers, experts and the MoE layer without a process group: capacity, dropping order,
no-drop mode, tie-breaking, the load-balancing and z-loss against hand computations, noise,
one batched matmul for all local experts, and the per-expert checkpoint layout."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from kolossos.moe import (
    MOE_CONTEXT,
    Experts,
    MoeCrossEntropyLoss,
    MoeLayer,
    MoeLoss,
    NormalNoiseGenerator,
    Top1Router,
    Top2Router,
    TopKRouter,
    UniformNoiseGenerator,
    moe_set_seed,
)


@pytest.fixture(autouse=True)
def _fresh_context() -> None:
    MOE_CONTEXT.reset()


def test_capacity_rule_train_eval_and_no_drop() -> None:
    router = Top1Router(capacity_factor_train=1.25, capacity_factor_eval=2.0, min_capacity=4)
    assert router.get_capacity(16, 4) == 6  # floor(1.25 * 16 / 4) = 5, rounded up to even
    assert router.get_capacity(4, 4) == 4  # min_capacity
    router.eval()
    assert router.get_capacity(16, 4) == 8
    assert Top2Router(capacity_factor_train=1.2, min_capacity=0).get_capacity(16, 4) == 10
    no_drop = Top2Router(capacity_factor_train=None)
    assert no_drop.get_capacity(16, 4) is None
    keep_in_eval = Top1Router(drop_tks=False).eval()
    assert keep_in_eval.get_capacity(16, 4) is None
    assert keep_in_eval.train().get_capacity(16, 4) == 6


def test_top1_drops_in_token_order() -> None:
    logits = torch.tensor([[3.0, 0.0]] * 5 + [[0.0, 3.0]])
    routing = Top1Router(capacity_factor_train=0.5, min_capacity=2)(logits)
    assert routing.capacity == 2  # floor(0.5 * 6 / 2) = 1 -> 2 (even) -> min 2
    assert routing.expert_index.flatten().tolist() == [0, 0, 0, 0, 0, 1]
    assert routing.kept.flatten().tolist() == [True, True, False, False, False, True]
    probs = torch.softmax(logits, -1)
    want = torch.tensor([probs[0, 0], probs[1, 0], 0, 0, 0, probs[5, 1]])
    torch.testing.assert_close(routing.combine_weight.flatten(), want)


def test_top2_first_choices_take_slots_before_second_choices() -> None:
    # every token prefers expert 0, then expert 1; capacity 2 per expert
    logits = torch.tensor([[2.0, 1.0, 0.0]] * 3)
    routing = Top2Router(capacity_factor_train=0.6, min_capacity=2)(logits)
    assert routing.capacity == 2
    assert routing.expert_index.tolist() == [[0, 1]] * 3
    # expert 0: tokens 0, 1 (first choices); expert 1: tokens 0, 1 (second choices)
    assert routing.kept.tolist() == [[True, True], [True, True], [False, False]]
    # no-drop mode keeps everything
    assert bool(Top2Router(capacity_factor_train=None)(logits).kept.all())


def test_ties_go_to_the_lower_expert_index() -> None:
    logits = torch.zeros(5, 4)
    assert Top1Router()(logits).expert_index.flatten().tolist() == [0] * 5
    assert TopKRouter(3)(logits).expert_index.tolist() == [[0, 1, 2]] * 5
    logits = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    assert Top2Router()(logits).expert_index.tolist() == [[1, 2]]


def test_aux_and_z_loss_against_a_hand_computation() -> None:
    logits = torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 0.5], [1.5, 0.0, 0.2]])
    s, e = logits.shape
    p = [[math.exp(v) / sum(math.exp(u) for u in row) for v in row] for row in logits.tolist()]
    mean_p = [sum(p[i][j] for i in range(s)) / s for j in range(e)]
    # top-1 picks 0, 1, 2, 0: fractions 2/4, 1/4, 1/4
    aux1 = e * sum(m * f for m, f in zip(mean_p, [0.5, 0.25, 0.25], strict=True))
    # top-2 picks (0,1) (1,0) (2,0) (0,2): 8 choices -> expert 0: 4, 1: 2, 2: 2 -> / s = 1, .5, .5
    aux2 = e / 2 * sum(m * f for m, f in zip(mean_p, [1.0, 0.5, 0.5], strict=True))
    lse = [math.log(sum(math.exp(v) for v in row)) for row in logits.tolist()]
    z = sum(v * v for v in lse) / s
    r1 = Top1Router(capacity_factor_train=None)(logits)
    r2 = Top2Router(capacity_factor_train=None)(logits)
    assert r2.expert_index.tolist() == [[0, 1], [1, 0], [2, 0], [0, 2]]
    assert r1.aux_loss.item() == pytest.approx(aux1, rel=1e-6)
    assert r2.aux_loss.item() == pytest.approx(aux2, rel=1e-6)
    assert r1.z_loss.item() == pytest.approx(z, rel=1e-6)
    # perfectly balanced uniform routing gives aux = 1
    assert Top1Router()(torch.eye(4) * 0).aux_loss.item() == pytest.approx(1.0)


def test_random_policy_fills_each_expert_to_capacity() -> None:
    torch.manual_seed(0)
    logits = torch.tensor([[1.0, 0.0]] * 10)
    routing = Top1Router(capacity_factor_train=0.4, min_capacity=2, select_policy="random")(logits)
    assert int(routing.kept.sum()) == routing.capacity == 2  # which 2: random
    torch.manual_seed(1)
    other = Top1Router(capacity_factor_train=0.4, min_capacity=2, select_policy="random")(logits)
    assert int(other.kept.sum()) == 2


def test_noise_only_in_training() -> None:
    torch.manual_seed(0)
    logits = torch.zeros(1000, 4)
    noisy = NormalNoiseGenerator(4)(logits)
    assert noisy.std().item() == pytest.approx(1 / 16, rel=0.1)
    jitter = UniformNoiseGenerator(0.1)(torch.ones(1000, 4))
    assert jitter.min().item() >= 0.9 and jitter.max().item() <= 1.1
    router = Top1Router(noisy_func=lambda t: t + torch.tensor([0.0, 5.0]))
    x = torch.tensor([[1.0, 0.0]])
    assert router(x).expert_index.item() == 1
    assert router.eval()(x).expert_index.item() == 0


def test_bad_arguments_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="capacity_factor_train=0 must be > 0, or None"):
        Top1Router(capacity_factor_train=0)
    with pytest.raises(ValueError, match="select_policy='best'"):
        Top1Router(select_policy="best")
    with pytest.raises(ValueError, match="at least k_value=3 experts"):
        TopKRouter(3)(torch.zeros(2, 2))
    with pytest.raises(TypeError, match="expert class once"):
        Experts(num_experts=2)
    with pytest.raises(ValueError, match="built for 2"):
        MoeLayer(4, 3, Top1Router(), Experts(nn.Linear, 2, in_features=4, out_features=4))


class _Matmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.__name__
        if any(m in name for m in ("mm", "matmul", "linear", "bmm")):
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


class FFN(nn.Module):
    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def test_all_local_experts_run_as_one_batched_matmul_per_linear() -> None:
    experts = Experts(expert=FFN, num_experts=8, d_model=4, d_ff=6)
    assert experts.experts.fc1.weight.shape == (8, 6, 4)
    x = torch.randn(8, 5, 4)
    with _Matmuls() as seen:
        out = experts(x)
    assert len(seen.calls) == 2, seen.calls  # fc1 and fc2, each once for all 8 experts
    for g in range(8):  # the same as each expert on its own rows
        w1, b1 = experts.experts.fc1.weight[g], experts.experts.fc1.bias[g]
        w2, b2 = experts.experts.fc2.weight[g], experts.experts.fc2.bias[g]
        want = torch.relu(x[g] @ w1.T + b1) @ w2.T + b2
        torch.testing.assert_close(out[g], want)
    assert all(vars(p)["moe_info"].ep_size == 1 for p in experts.parameters())


def test_expert_seed_follows_the_expert_and_the_layout_is_per_expert() -> None:
    moe_set_seed(3)
    a = Experts(expert=FFN, num_experts=4, d_model=4, d_ff=6)
    moe_set_seed(3)
    b = Experts(expert=FFN, num_experts=4, d_model=4, d_ff=6)
    torch.testing.assert_close(a.expert_state_dict(), b.expert_state_dict(), rtol=0, atol=0)
    state = a.expert_state_dict()
    assert sorted(state)[:2] == ["0.fc1.bias", "0.fc1.weight"] and len(state) == 16
    assert not torch.equal(state["0.fc1.weight"], state["1.fc1.weight"])  # experts differ
    with torch.random.fork_rng():  # expert 2 is what FFN builds from seed 3 + 2
        torch.manual_seed(5)
        alone = FFN(4, 6)
    torch.testing.assert_close(state["2.fc1.weight"], alone.fc1.weight.detach())
    c = Experts(expert=FFN, num_experts=4, d_model=4, d_ff=6)
    c.load_expert_state_dict(state)
    torch.testing.assert_close(c.expert_state_dict(), state)
    with pytest.raises(KeyError, match=r"lacks '3\.fc2\.bias'"):
        c.load_expert_state_dict({k: v for k, v in state.items() if k != "3.fc2.bias"})


def test_layer_records_losses_and_moe_loss_adds_them_once() -> None:
    torch.manual_seed(0)
    experts = Experts(expert=FFN, num_experts=4, d_model=4, d_ff=6)
    layer = MoeLayer(4, 4, Top2Router(capacity_factor_train=None), experts)
    x = torch.randn(2, 3, 4)
    y = layer(x)
    assert y.shape == x.shape
    routing = layer.last_routing
    assert routing is not None
    aux = routing.aux_loss
    criterion = MoeLoss(aux_weight=0.5, loss_fn=nn.MSELoss)
    loss = criterion(y, torch.zeros_like(y))
    torch.testing.assert_close(loss, nn.MSELoss()(y, torch.zeros_like(y)) + 0.5 * aux)
    assert MOE_CONTEXT.get_loss() == 0.0  # consumed
    ce = MoeCrossEntropyLoss(aux_weight=0.01, label_smoothing=0.1)
    assert isinstance(ce.loss_fn, nn.CrossEntropyLoss) and ce.loss_fn.label_smoothing == 0.1
    # every token's output is the weighted sum of its kept experts' outputs
    tokens = x.reshape(-1, 4)
    stacked = experts(tokens.unsqueeze(0).expand(4, -1, -1))  # every token through every expert
    want = torch.zeros_like(tokens)
    for j in range(2):
        idx = routing.expert_index[:, j]
        want += routing.combine_weight[:, j : j + 1] * stacked[idx, torch.arange(6)]
    torch.testing.assert_close(y.reshape(-1, 4), want)
