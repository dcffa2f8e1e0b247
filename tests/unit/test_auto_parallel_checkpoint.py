"""CheckpointSolverRotor: optimal against brute force, measured peak within the budget, and training
with the plan is bitwise identical to training without it."""

from __future__ import annotations

import copy
import itertools
import random

import pytest
import torch

from kolossos.accelerator import ACTIVATIONS, TensorMemoryTracker
from kolossos.auto_parallel import TracingError
from kolossos.auto_parallel.checkpoint import (
    Chain,
    CheckpointSegment,
    CheckpointSolverRotor,
    InfeasibleBudgetError,
    Segment,
    Stage,
    activation_bytes,
    apply_checkpoint_plan,
    linearize,
    plan_peak,
    profile_chain,
)
from kolossos.testing.parity import assert_moved, snapshot


def _random_chain(rng: random.Random, n: int) -> Chain:
    stages = []
    for i in range(n):
        out = rng.randint(1, 8) * 64
        saved = out + rng.randint(0, 40) * 64
        stages.append(
            Stage(
                name=str(i),
                forward_time=float(rng.randint(1, 9)),
                saved_bytes=saved,
                output_bytes=out,
                forward_peak_bytes=saved + rng.randint(0, 8) * 64,
                backward_peak_bytes=out + rng.randint(0, 16) * 64,
            )
        )
    return Chain(stages=tuple(stages))


def _all_plans(n: int) -> list[tuple[Segment, ...]]:
    plans = []
    for cuts in itertools.product((False, True), repeat=n - 1):
        bounds = [0] + [i + 1 for i, cut in enumerate(cuts) if cut] + [n]
        pairs = list(itertools.pairwise(bounds))
        for flags in itertools.product((False, True), repeat=len(pairs)):
            plans.append(
                tuple(
                    Segment(start=s, end=e, checkpointed=f)
                    for (s, e), f in zip(pairs, flags, strict=True)
                )
            )
    return plans


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("slots", [None, 50])
def test_dp_matches_brute_force(seed: int, slots: int | None) -> None:
    rng = random.Random(seed)
    chain = _random_chain(rng, rng.randint(3, 6))
    no_ckpt_peak, _ = plan_peak(chain, (Segment(start=0, end=len(chain), checkpointed=False),))
    for fraction in (1.0, 0.8, 0.6, 0.45, 0.35, 0.25):
        budget = int(no_ckpt_peak * fraction)
        solver = CheckpointSolverRotor(chain, budget, memory_slots=slots)
        feasible = []
        for plan in _all_plans(len(chain)):
            peak, cost = plan_peak(chain, plan, solver.unit)
            if peak <= solver.budget_units:
                feasible.append(cost)
        if not feasible:
            with pytest.raises(InfeasibleBudgetError, match="most frugal plan needs"):
                solver.solve()
            assert solver.minimum_memory() > solver.budget_units * solver.unit
            continue
        plan = solver.solve()
        assert plan.recompute_time == min(feasible)
        assert plan.predicted_peak_bytes <= budget


class _Block(torch.nn.Module):
    """A pre-norm residual MLP block (a transformer block without attention)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.fc1 = torch.nn.Linear(hidden, 4 * hidden)
        self.fc2 = torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class _SquareLoss(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.square().mean()


def _stages(seed: int = 0) -> list[torch.nn.Module]:
    torch.manual_seed(seed)
    return [*(_Block(32) for _ in range(6)), _SquareLoss()]


def _measured_step(model: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    with TensorMemoryTracker("cpu") as tracker:
        tracker.track(model)
        with tracker.category(ACTIVATIONS):
            loss = model(x)
            loss.backward()
    return loss.detach(), activation_bytes(tracker, "peak")


class _Bottleneck(torch.nn.Module):
    """A ResNet bottleneck block (1x1 expand, 3x3, 1x1 reduce) with GroupNorm: BatchNorm's
    running statistics would be updated twice by the recomputation."""

    def __init__(self, channels: int, expansion: int = 4) -> None:
        super().__init__()
        inner = channels * expansion
        self.conv1 = torch.nn.Conv2d(channels, inner, 1, bias=False)
        self.norm1 = torch.nn.GroupNorm(4, inner)
        self.conv2 = torch.nn.Conv2d(inner, inner, 3, padding=1, bias=False)
        self.norm2 = torch.nn.GroupNorm(4, inner)
        self.conv3 = torch.nn.Conv2d(inner, channels, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.norm1(self.conv1(x)))
        out = torch.relu(self.norm2(self.conv2(out)))
        return torch.relu(x + self.conv3(out))


def _resnet_stages() -> list[torch.nn.Module]:
    torch.manual_seed(0)
    stem = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU())
    return [stem, *(_Bottleneck(8) for _ in range(6)), _SquareLoss()]


MODELS = {
    "mlp-blocks": (lambda: _stages(), (16, 16, 32)),
    "resnet-blocks": (_resnet_stages, (2, 3, 16, 16)),
}


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_measured_peak_within_budget_at_three_budgets(kind: str) -> None:
    make, shape = MODELS[kind]
    stages = make()
    x = torch.randn(*shape)
    plain = torch.nn.Sequential(*stages)
    loss_ref, full_peak = _measured_step(plain, x)
    grads_ref = [p.grad.clone() for p in plain.parameters() if p.grad is not None]
    chain = profile_chain(stages, x)
    checkpointed: list[int] = []
    print(f"\n{kind}: no-checkpoint activation peak {full_peak} B")
    print("budget %  budget B  predicted B  measured B  recompute s  plan")
    for fraction in (1.0, 0.6, 0.35):
        budget = int(full_peak * fraction)
        solver = CheckpointSolverRotor(chain, budget)
        plan = solver.solve()
        costs = [plan_peak(chain, c, solver.unit) for c in _all_plans(len(chain))]
        cheapest = min(cost for peak, cost in costs if peak <= solver.budget_units)
        assert plan.recompute_time <= cheapest * (1 + 1e-9)  # brute force over 3**7 plans
        for p in plain.parameters():
            p.grad = None
        loss, peak = _measured_step(apply_checkpoint_plan(stages, plan), x)
        print(
            f"{fraction:>8.0%}  {budget:>8}  {plan.predicted_peak_bytes:>11}  {peak:>10}  "
            f"{plan.recompute_time:>11.2e}  {plan.describe()}"
        )
        assert peak <= plan.predicted_peak_bytes <= budget
        assert torch.equal(loss, loss_ref)
        grads = [p.grad for p in plain.parameters() if p.grad is not None]
        assert all(torch.equal(a, b) for a, b in zip(grads, grads_ref, strict=True))
        checkpointed.append(len(plan.checkpointed_stages))
    assert checkpointed[0] <= checkpointed[1] < checkpointed[2]


def _train(model: torch.nn.Module, steps: int) -> list[torch.Tensor]:
    torch.manual_seed(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(8, 16, 32))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    return losses


def test_training_with_plan_is_bitwise_identical() -> None:
    reference_stages = _stages(seed=3)
    stages = copy.deepcopy(reference_stages)
    chain = profile_chain(stages, torch.randn(8, 16, 32))
    no_ckpt, _ = plan_peak(chain, (Segment(start=0, end=len(chain), checkpointed=False),))
    plan = CheckpointSolverRotor(chain, int(no_ckpt * 0.4)).solve()
    model = apply_checkpoint_plan(stages, plan)
    assert any(isinstance(m, CheckpointSegment) for m in model)
    reference = torch.nn.Sequential(*reference_stages)
    before = snapshot(reference)
    expected = _train(reference, steps=3)
    got = _train(model, steps=3)
    assert torch.equal(torch.stack(got), torch.stack(expected))
    assert_moved(before, reference, 1e-4)  # the comparison is exact: any move counts
    for (name, a), b in zip(reference.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_gpt2_blocks_chain() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_embd=16, n_layer=4, n_head=2, n_positions=16, vocab_size=64, bos_token_id=0,
        eos_token_id=0, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    blocks = [*transformers.GPT2Model(config).h, _SquareLoss()]
    x = torch.randn(4, 16, 16)
    plain = torch.nn.Sequential(*blocks)
    loss_ref, full_peak = _measured_step(plain, x)
    grads_ref = [p.grad.clone() for p in plain.parameters()]
    chain = profile_chain(blocks, x)
    plan = CheckpointSolverRotor(chain, int(full_peak * 0.5)).solve()
    assert plan.checkpointed_stages
    for p in plain.parameters():
        p.grad = None
    model = apply_checkpoint_plan(blocks, plan)
    loss, peak = _measured_step(model, x)
    assert peak <= int(full_peak * 0.5)
    assert torch.equal(loss, loss_ref)
    for g, p in zip(grads_ref, model.parameters(), strict=True):
        assert torch.equal(g, p.grad)


def test_bad_inputs() -> None:
    chain = _random_chain(random.Random(0), 3)
    with pytest.raises(ValueError, match="free_memory"):
        CheckpointSolverRotor(chain, 0)
    with pytest.raises(InfeasibleBudgetError, match="most frugal plan"):
        CheckpointSolverRotor(chain, 1, memory_slots=None).solve()
    plan = CheckpointSolverRotor(chain, 10**9).solve()
    with pytest.raises(ValueError, match="covers 3 stages"):
        apply_checkpoint_plan([torch.nn.Identity()], plan)
    with pytest.raises(ValueError, match="must be >= 0"):
        Stage(name="x", forward_time=1.0, saved_bytes=-1, output_bytes=0,
              forward_peak_bytes=0, backward_peak_bytes=0)  # fmt: skip
    with pytest.raises(ValueError, match="does not start"):
        plan_peak(chain, (Segment(start=1, end=3, checkpointed=False),))


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.embed = torch.nn.Linear(8, 32)
        self.blocks = torch.nn.Sequential(*(_Block(32) for _ in range(5)))
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.blocks(self.embed(x))))


def test_linearize_then_checkpoint_gives_identical_gradients() -> None:
    reference = _Net()
    model = copy.deepcopy(reference)
    names, stages = linearize(model, {"x": torch.empty(4, 16, 8, device="meta")}, depth=2)
    assert names == ["embed", *(f"blocks.{i}" for i in range(5)), "head"]
    assert {id(p) for p in model.parameters()} == {id(p) for s in stages for p in s.parameters()}
    x = torch.randn(4, 16, 8)
    chain = profile_chain([*stages, _SquareLoss()], x)
    no_ckpt, _ = plan_peak(chain, (Segment(start=0, end=len(chain), checkpointed=False),))
    plan = CheckpointSolverRotor(chain, int(no_ckpt * 0.5)).solve()
    assert plan.checkpointed_stages
    chained = apply_checkpoint_plan([*stages, _SquareLoss()], plan)
    loss = chained(x)
    loss.backward()
    loss_ref = reference(x).square().mean()
    loss_ref.backward()
    assert torch.equal(loss, loss_ref)
    grads = {n: p.grad for n, p in model.named_parameters()}
    for name, p in reference.named_parameters():
        assert torch.equal(p.grad, grads[name]), name


def test_linearize_rejects_skip_across_blocks() -> None:
    class Skip(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x)) + x

    with pytest.raises(TracingError, match=r"block 'b'.*not a chain at depth=1"):
        linearize(Skip(), {"x": torch.empty(2, 4, device="meta")})
    with pytest.raises(ValueError, match="depth=0"):
        linearize(Skip(), {"x": torch.empty(2, 4, device="meta")}, depth=0)
