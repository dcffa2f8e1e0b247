"""``autoparallelize`` on a user-given 2 x 2 mesh (4 gloo ranks) vs single-process training.

GPT-2 (2 layers, hidden 32, 4 heads, vocabulary 128, no dropout), batch 8 x 24 tokens, fp32,
Adam, the fixed communication-bound costs of ``test_auto_parallel_gpt2``. On a (D, T) = (2, 2)
mesh the search considers ``dp``, ``megatron`` and ``replicated`` over all 4 ranks and
``dp2xtp2`` on the mesh's own axes. Cases: a torch mesh named ``("dp", "tp")`` at a budget
between the data-parallel and the Megatron memory (→ ``dp2xtp2``); an unnamed torch mesh
whose rank layout differs from the one the executor would invent (data-parallel groups
{0, 1}, {2, 3} instead of {0, 2}, {1, 3}), same budget (→ ``dp2xtp2`` on those groups); a
kolossos ``DeviceMesh`` without a budget (→ ``dp`` over the flattened mesh). Each trains
STEPS steps like one process: the loss at every step, the gathered parameters at the end,
every parameter moved by more than 10x the tolerance.

Also: dim names ``("tp", "dp")`` are read by name; bad meshes and sizes raise on rank 0 alone
before any collective (a collective there would hang or break the other ranks' barrier); the
measured default calibration runs (a transformer on the 2-d mesh, an MLP on the 1-d world);
an injected contention factor reaches the search.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
from torch.distributed.device_mesh import init_device_mesh

from kolossos.auto_parallel import AutoParallelModule, CostModel, autoparallelize
from kolossos.auto_parallel.auto_mesh import resolve_mesh
from kolossos.auto_parallel.module_graph import trace_operators
from kolossos.auto_parallel.transformer_plan import family_plan
from kolossos.device.device_mesh import DeviceMesh
from kolossos.testing import distributed
from kolossos.testing.parity import (
    assert_run_matches,
    global_mean,
    reference_causal_lm,
    train_causal_lm,
)

pytestmark = pytest.mark.dist

BATCH, SEQ, STEPS, LR = 8, 24, 4, 1e-2
TOL = 2e-5  # fp32; only the order of sums changes (as test_autoparallelize_gpt2)
COST = {"flops_per_s": 5e9, "alpha": 1e-6, "beta": 1e-8}


def _gpt2(hidden: int = 32, heads: int = 4) -> torch.nn.Module:
    import transformers as tf

    config = tf.GPT2Config(n_layer=2, n_embd=hidden, n_head=heads, vocab_size=128,
                           n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                           use_cache=False, bos_token_id=0, eos_token_id=0)  # fmt: skip
    return tf.GPT2LMHeadModel(config)


def _meta(batch: int = BATCH) -> dict[str, torch.Tensor]:
    ids = torch.empty(batch, SEQ, dtype=torch.long, device="meta")
    return {"input_ids": ids, "labels": ids}


def _errors_before_any_collective() -> None:
    """Rank 0 alone: each call must raise before its first collective."""
    model = _gpt2()
    with pytest.raises(ValueError, match=r"holds 2 ranks but the job has 4"):
        autoparallelize(model, _meta(), DeviceMesh(torch.arange(2), (2,), device="cpu"))
    with pytest.raises(ValueError, match=r"batch of 6 .* 4 data-parallel ranks"):
        autoparallelize(model, _meta(6), DeviceMesh(torch.arange(4), (4, 1), device="cpu"))
    with pytest.raises(ValueError, match=r"num_attention_heads=3 .* 2 tensor-parallel ranks"):
        autoparallelize(_gpt2(hidden=24, heads=3), _meta(), DeviceMesh(torch.arange(4), (2, 2)))
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with pytest.raises(NotImplementedError, match=r"MLP chains on a 1-d mesh only.*2 x 2"):
        autoparallelize(mlp, {"input": torch.empty(8, 8, device="meta")},
                        DeviceMesh(torch.arange(4), (2, 2)))  # fmt: skip
    with pytest.raises(ValueError, match=r"contention=0\.5 must be >= 1"):
        autoparallelize(model, _meta(), contention=0.5)


@distributed(4, timeout=300)
def test_autoparallelize_user_mesh2d_parity() -> None:
    rank = dist.get_rank()
    if rank == 0:
        _errors_before_any_collective()
    dist.barrier()
    named = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    unnamed = TorchDeviceMesh("cpu", torch.tensor([[0, 2], [1, 3]]))  # dp {0,1}, tp {0,2}
    with pytest.raises(ValueError, match=r"mesh_dim_names=\('data', 'model'\).*\('dp', 'tp'\)"):
        autoparallelize(
            _gpt2(), _meta(), init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "model"))
        )
    # ("tp", "dp"): the axes are read by name, not by position.
    swapped = resolve_mesh(init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp")))
    assert swapped.grid is not None
    assert swapped.grid["dp"].mesh.tolist() == [[0, 1], [2, 3]][rank // 2]
    assert swapped.grid["tp"].mesh.tolist() == [[0, 2], [1, 3]][rank % 2]

    cost = CostModel(world_size=4, **COST)
    torch.manual_seed(0)
    base = _gpt2()
    ids, reference, before, ref_losses = reference_causal_lm(base, STEPS, BATCH, SEQ, LR)
    groups = trace_operators(_gpt2(), _meta())
    between = (family_plan("dp", groups, cost).memory + family_plan("megatron", groups,
                                                                     cost).memory) / 2  # fmt: skip
    cases = [
        ("named", named, between, "dp2xtp2", [[0, 2], [1, 3]][rank % 2]),
        ("unnamed", unnamed, between, "dp2xtp2", [[0, 1], [2, 3]][rank // 2]),
        ("kolossos", DeviceMesh(torch.arange(4), (2, 2)), None, "dp", [0, 1, 2, 3]),
    ]
    for label, mesh, budget, family, dp_ranks in cases:
        model = autoparallelize(copy.deepcopy(base), _meta(), mesh, budget, cost_model=cost)
        assert model.family == family, (label, model.family)
        assert model.batch_mesh is not None and model.batch_mesh.mesh.tolist() == dp_ranks, label
        losses = train_causal_lm(model, ids, LR, model.local_batch)
        reduced = [global_mean(x) for x in losses]
        assert_run_matches(reduced, ref_losses, model.full_state_dict(), reference, before,
                           loss_atol=TOL, param_atol=TOL, label=label)  # fmt: skip

    # Costs of a slow gradient all-reduce: replicating wins uncontended; with the compute 100x
    # slower a family that splits the compute does (tests/unit/test_auto_parallel_contention.py).
    slow_comm = CostModel(world_size=4, flops_per_s=5e9, alpha=1e-4, beta=1e-7, op_s=2e-6)
    plain = autoparallelize(copy.deepcopy(base), _meta(), named, cost_model=slow_comm)
    loaded = autoparallelize(copy.deepcopy(base), _meta(), named, cost_model=slow_comm,
                             contention=100.0)  # fmt: skip
    assert (plain.family, loaded.family != "replicated") == ("replicated", True), loaded.family
    # The default: costs measured on the ranks, contention included (about 1 s).
    measured = autoparallelize(copy.deepcopy(base), _meta(), named)
    assert measured.family in ("dp", "megatron", "replicated", "dp2xtp2")
    mlp = autoparallelize(torch.nn.Sequential(torch.nn.Linear(8, 8)),
                          {"input": torch.empty(8, 8, device="meta")})  # fmt: skip
    assert isinstance(mlp, AutoParallelModule)
