"""Checkpoint search inside ``autoparallelize`` for transformers (no process group).

A 4-layer GPT-2 (hidden 32, vocabulary 128, batch 8 x 24) priced on 2 ranks with fixed
communication-bound costs: the repeated blocks are ``transformer.h.0..3``; no checkpointing
while a family fits as it is; when none fits, each family's Rotor recompute time equals the
brute-force minimum over every segmentation of its blocks that fits, and the fastest
checkpointed family is taken; a budget under every reachable peak names the budget and the
smallest peak; recomputing blocks leaves loss and gradients bitwise equal.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from kolossos.auto_parallel import CostModel, InfeasibleBudgetError
from kolossos.auto_parallel.checkpoint import Segment, plan_peak
from kolossos.auto_parallel.module_graph import OperatorGroup, trace_operators
from kolossos.auto_parallel.transformer_checkpoint import (
    apply_block_checkpoint,
    block_chain,
    checkpoint_family,
    repeated_blocks,
    search_with_checkpoint,
    smallest_peak,
)
from kolossos.auto_parallel.transformer_plan import family_plans

BATCH, SEQ, LAYERS = 8, 24, 4
COST = CostModel(world_size=2, flops_per_s=5e9, alpha=1e-6, beta=1e-8)


def _gpt2(layers: int = LAYERS) -> torch.nn.Module:
    import transformers as tf

    config = tf.GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=128, n_positions=32,
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                           bos_token_id=0, eos_token_id=0)  # fmt: skip
    return tf.GPT2LMHeadModel(config)


def _trace(layers: int = LAYERS) -> list[OperatorGroup]:
    ids = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")
    return trace_operators(_gpt2(layers), {"input_ids": ids, "labels": ids})


@pytest.fixture(scope="module")
def groups() -> list[OperatorGroup]:
    return _trace()


def _segmentations(n: int) -> list[tuple[Segment, ...]]:
    """Every cut of ``n`` stages into consecutive segments, each checkpointed or not."""
    result = []
    for cuts in itertools.product([False, True], repeat=n - 1):
        bounds = [0, *(i + 1 for i, cut in enumerate(cuts) if cut), n]
        spans = list(itertools.pairwise(bounds))
        for flags in itertools.product([False, True], repeat=len(spans)):
            pairs = zip(spans, flags, strict=True)
            result.append(tuple(Segment(start=a, end=b, checkpointed=f) for (a, b), f in pairs))
    return result


def test_repeated_blocks(groups) -> None:
    names, members = repeated_blocks(groups)
    assert names == [f"transformer.h.{i}" for i in range(LAYERS)]
    for name, positions in zip(names, members, strict=True):
        assert all(groups[i].path.startswith(name + ".") for i in positions)
        assert groups[positions[-1]].kind == "add"  # the block ends in its second residual add


def test_no_checkpointing_while_a_family_fits(groups) -> None:
    plans = family_plans(groups, COST)
    fastest = min(plans, key=lambda f: plans[f][0].step_time)
    leanest = min(plans, key=lambda f: plans[f][0].memory)
    for budget, want in ((None, fastest), (plans[leanest][0].memory, leanest)):
        family, _, _, recompute = search_with_checkpoint(groups, COST, budget)
        assert (family, recompute) == (want, None)


@pytest.mark.parametrize("fraction", [0.1, 0.25, 0.5, 0.75, 0.9])
def test_rotor_recompute_is_the_brute_force_minimum(groups, fraction: float) -> None:
    plans = family_plans(groups, COST)
    lowest = min(plan.memory for plan, _ in plans.values())
    floor = min(smallest_peak(ops, plan, COST.world_size) for plan, ops in plans.values())
    budget = lowest - fraction * (lowest - floor)
    family, _, _, chosen = search_with_checkpoint(groups, COST, budget)
    assert chosen is not None and chosen.memory <= budget
    for name, (plan, ops) in plans.items():
        _, chain, held = block_chain(ops, plan, COST.world_size)
        fixed = sum(s.memory for s in plan.strategies) - held
        fits = [
            recompute
            for segments in _segmentations(len(chain))
            for peak, recompute in [plan_peak(chain, segments)]
            if fixed + peak <= budget
        ]
        if not fits:
            with pytest.raises(InfeasibleBudgetError):
                checkpoint_family(ops, plan, COST.world_size, budget)
            continue
        found = checkpoint_family(ops, plan, COST.world_size, budget)
        assert found.plan.recompute_time == pytest.approx(min(fits), rel=1e-12), name
        assert found.memory <= budget
        assert found.step_time >= chosen.step_time or name == family


def test_infeasible_budget_names_budget_and_smallest_peak(groups) -> None:
    plans = family_plans(groups, COST)
    floor = min(smallest_peak(ops, plan, COST.world_size) for plan, ops in plans.values())
    assert floor == 1_280_004  # Megatron recomputing 3 of the 4 blocks
    search_with_checkpoint(groups, COST, floor)  # reachable exactly
    with pytest.raises(InfeasibleBudgetError, match=r"1279999 bytes.*smallest reachable peak"):
        search_with_checkpoint(groups, COST, floor - 5)


def test_one_block_is_no_chain() -> None:
    one = _trace(layers=1)
    assert repeated_blocks(one) == ([], [])
    with pytest.raises(InfeasibleBudgetError, match="repeated blocks"):
        search_with_checkpoint(one, COST, 10_000)


def test_recomputed_blocks_give_equal_loss_and_gradients() -> None:
    torch.manual_seed(0)
    model = _gpt2()
    checkpointed = copy.deepcopy(model)
    apply_block_checkpoint(checkpointed, ["transformer.h.0", "transformer.h.2"])
    ids = torch.randint(0, 128, (BATCH, SEQ))
    losses = []
    for m in (model, checkpointed):
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
    assert torch.equal(losses[0], losses[1])
    for (name, a), b in zip(model.named_parameters(), checkpointed.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name
