"""``autoparallelize`` with activation checkpointing inside it, 2 and 4 gloo ranks vs one process.

GPT-2 (4 layers, hidden 32, 4 heads, vocabulary 128, no dropout), batch 8 x 24 tokens, fp32,
Adam, the fixed communication-bound costs of ``test_autoparallelize_gpt2``. At budgets between
the smallest plan family's memory and the smallest peak checkpointing reaches, the search
combines a family with a Rotor plan recomputing some of the ``transformer.h.*`` blocks (2 ranks:
data parallel with 2 and 3 blocks recomputed, Megatron with 3; 4 ranks: the 2 x 2 layout with 2
and 3); without a budget nothing is recomputed. Each trains STEPS steps from the same weights as
a single process on the whole batch: the loss matches at every step, the gathered parameters at
the end, every parameter moved by more than 10x the parameter tolerance, and every rank's
measured peak (``TensorMemoryTracker``: parameters, gradients, Adam states, activations,
buffers) from the second step on stays within the budget.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from kolossos.accelerator import TensorMemoryTracker
from kolossos.auto_parallel import CostModel, autoparallelize
from kolossos.auto_parallel.module_graph import OperatorGroup, trace_operators
from kolossos.auto_parallel.transformer_checkpoint import smallest_peak
from kolossos.auto_parallel.transformer_plan import family_plans
from kolossos.testing import distributed
from kolossos.testing.parity import assert_run_matches, global_mean, snapshot

pytestmark = pytest.mark.dist

BATCH, SEQ, STEPS, LR = 8, 24, 4, 1e-2
# fp32; recomputation repeats the same kernels, only the order of sums changes (the gradient
# average, row-parallel partial sums): the differences are a few 1e-7.
TOL = 2e-5
# Parameters: one element of ``wte`` (of 4096) ends 3.0e-5 away under Megatron, checkpointed or
# not (measured: the same 3.0071e-5 without checkpointing): Adam normalises a near-zero gradient
# of a rarely seen token, which magnifies the reordered vocabulary-parallel sums.
PARAM_TOL = 5e-5
COST = {"flops_per_s": 5e9, "alpha": 1e-6, "beta": 1e-8}


def _gpt2() -> torch.nn.Module:
    import transformers as tf

    config = tf.GPT2Config(n_layer=4, n_embd=32, n_head=4, vocab_size=128, n_positions=32,
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                           bos_token_id=0, eos_token_id=0)  # fmt: skip
    return tf.GPT2LMHeadModel(config)


def _train(model, ids: torch.Tensor, local) -> tuple[list[torch.Tensor], int]:  # type: ignore[no-untyped-def]
    """Losses of STEPS Adam steps and the largest measured peak of steps 2.. (Adam states exist)."""
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses, peak = [], 0
    for step in range(STEPS):
        batch = local(ids[step])
        with TensorMemoryTracker("cpu") as tracker:
            tracker.track(model, opt)
            tracker.reset_peak()
            loss = model(input_ids=batch, labels=batch).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        if step:
            peak = max(peak, tracker.peak_bytes)
        losses.append(loss.detach())
    return losses, peak


def _budget_points(cost: CostModel) -> tuple[float, float]:
    """``(smallest family memory, smallest peak reachable with checkpointing)``."""
    model = _gpt2()

    def trace(batch: int) -> list[OperatorGroup]:
        ids = torch.empty(batch, SEQ, dtype=torch.long, device="meta")
        return trace_operators(model, {"input_ids": ids, "labels": ids})

    groups, hybrid = trace(BATCH), trace(BATCH // 2)
    # at 4 ranks the 2 x 2 layout, traced at half the batch, is a family too
    plans = family_plans(groups, cost, {2: hybrid} if cost.world_size == 4 else None)
    lowest = min(plan.memory for plan, _ in plans.values())
    reachable = [smallest_peak(ops, plan, cost.world_size) for plan, ops in plans.values()]
    assert min(reachable) < lowest
    return lowest, min(reachable)


# (fraction of the way from the leanest family's memory down to the smallest reachable peak, or
# None for no budget; family; blocks recomputed). The fixed costs make data parallelism fastest
# while its checkpointed peak fits; below that Megatron (2 ranks) or the 2 x 2 layout (4 ranks).
CASES = {
    2: [(None, "dp", 0), (0.25, "dp", 2), (0.5, "dp", 3), (0.9, "megatron", 3)],
    4: [(None, "dp", 0), (0.5, "dp2xtp2", 2), (0.9, "dp2xtp2", 3)],
}


@pytest.mark.parametrize("world_size", [2, 4])
@distributed()
def test_autoparallelize_checkpoint_parity(world_size: int) -> None:
    cost = CostModel(world_size=world_size, **COST)
    torch.manual_seed(0)
    base = _gpt2()
    ids = torch.randint(0, 128, (STEPS, BATCH, SEQ))
    reference = copy.deepcopy(base)
    before = snapshot(reference)
    ref_losses, _ = _train(reference, ids, lambda t: t)
    meta_ids = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")
    meta = {"input_ids": meta_ids, "labels": meta_ids}
    lowest, reachable = _budget_points(cost)
    for fraction, family, blocks in CASES[world_size]:
        budget = None if fraction is None else lowest - fraction * (lowest - reachable)
        model = autoparallelize(copy.deepcopy(base), meta, memory_budget=budget, cost_model=cost)
        assert model.family == family, (budget, model.family)
        if budget is None:
            assert model.recompute is None
        else:
            assert len(model.recompute.recomputed) == blocks, model.recompute.describe()
            assert model.recompute.memory <= budget
            assert "recomputed transformer.h." in model.explain()
        if dist.get_rank() == 0:
            model.print_plan()
        losses, peak = _train(model, ids, model.local_batch)
        reduced = [global_mean(x) if model.data_parallel else float(x) for x in losses]
        params = model.full_state_dict()
        assert_run_matches(reduced, ref_losses, params, reference, before,
                           loss_atol=TOL, param_atol=PARAM_TOL, label=model.family)  # fmt: skip
        if budget is not None:
            assert peak <= budget, (peak, budget, model.recompute.memory)
            print(f"rank {dist.get_rank()}: budget {budget:.0f} B, predicted "
                  f"{model.recompute.memory:.0f} B, measured peak {peak} B")  # fmt: skip
