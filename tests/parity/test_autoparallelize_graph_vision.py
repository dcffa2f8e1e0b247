"""The graph executor (``apply_graph_plan``) on vision models vs single-process training, 2 gloo
ranks: a tiny Hugging Face ViT and the timm-style Bottleneck ResNet of
``tests/unit/test_auto_parallel_tracer_models.py`` (``_ResNet``) with a cross-entropy head.

* ViT (8 x 8 images, 4 x 4 patches, 2 layers, hidden 32, 4 heads, MLP 64, 6 classes, dropout
  0, no q/k/v bias, batch 16): the Megatron assignment run by the executor, a data-parallel
  plan whose classifier splits the classes into a class-parallel cross entropy on
  ``[batch, classes]`` logits, and the ILP's own
  optimum at a budget below the data-parallel memory (checked to mix a column-parallel patch
  convolution and ``col``/``row`` linears with ``dp``; the CLS token and position embeddings
  batch-sharded, the loss on ``[batch, classes]`` logits batch-sharded).
* ResNet (16 x 16 images, batch 8, BatchNorms in training mode): ``dp`` (BatchNorms under
  ``B`` with synchronised statistics, equal to one process's BatchNorm on the whole batch), and
  the ILP's optimum at 90 % of the data-parallel memory (checked to mix ``col`` convolutions
  and ``F`` BatchNorms with ``dp``).

Each trains STEPS Adam steps from the same weights as a single process on the whole batch:
the first step's gathered gradients within GRAD_TOL (Adam alone hides a gradient off by a
constant factor), the loss every step, the gathered parameters at the end, every parameter
moved by more than 10x the parameter tolerance, and for the ResNet the BatchNorms' running
statistics (gathered where sharded) after the first step and at the end.
"""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from kolossos.auto_parallel import CostModel, autoparallelize
from kolossos.auto_parallel.apply_graph import AutoParallelGraph, apply_graph_plan
from kolossos.auto_parallel.module_graph import OperatorGroup, trace_operators
from kolossos.auto_parallel.sharding_graph import DagPlan, evaluate
from kolossos.auto_parallel.transformer_plan import family_plan, search_free
from kolossos.auto_parallel.transformer_strategies import megatron_assignment, transformer_graph
from kolossos.testing import distributed
from kolossos.testing.parity import assert_run_matches, snapshot

pytestmark = pytest.mark.dist

STEPS, LR, SGD_LR, CLASSES = 3, 1e-2, 0.1, 6
TOL = 2e-5  # fp32 losses: only the order of sums changes
PARAM_TOLS = {"vit": 5e-5, "resnet": 1e-5}  # the graph executor tests' with Adam; SGD
# moves each parameter by lr x its gradient, whose rounding stays ~1e-7
GRAD_TOL = 1e-6
# The ResNet's first gradients: BatchNorm divides by per-channel deviations, which turns fp32
# rounding of the (differently ordered) statistics into relative errors of ~1e-6 (measured
# up to 2e-6 absolute on conv1's weight; the formula is exact in float64 to 1e-14).
GRAD_TOLS = {"vit": GRAD_TOL, "resnet": 5e-6}
STAT_TOL = 1e-6  # running statistics: the same sums in another order
COST = {"flops_per_s": 1e9, "alpha": 1e-6, "beta": 1e-8}


def _vit() -> torch.nn.Module:
    import transformers as tf

    config = tf.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=32,
                          num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                          num_labels=CLASSES, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0, qkv_bias=False)  # fmt: skip
    return tf.ViTForImageClassification(config)


def _resnet_class() -> type[torch.nn.Module]:
    path = Path(__file__).parents[1] / "unit" / "test_auto_parallel_tracer_models.py"
    spec = importlib.util.spec_from_file_location("_graph_vision_models", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    resnet: type[torch.nn.Module] = module._ResNet
    return resnet


class _Classifier(torch.nn.Module):
    """The ResNet with a cross-entropy loss, returning it as ``.loss`` like a Hugging Face
    model (a plain tensor would do as well)."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, pixel_values: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": torch.nn.functional.cross_entropy(self.net(pixel_values), labels)}


def _loss(out: object) -> torch.Tensor:
    loss = out["loss"] if isinstance(out, dict) else out.loss  # type: ignore[attr-defined]
    assert isinstance(loss, torch.Tensor)
    return loss


def _train(
    kind: str, model: torch.nn.Module, pixels: torch.Tensor, labels: torch.Tensor
) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Adam steps on ``pixels[step]``; the losses, and the (gathered) gradients and buffers
    after the first backward."""
    opt: torch.optim.Optimizer
    if kind == "vit":
        opt = torch.optim.Adam(model.parameters(), lr=LR)
    else:  # Adam turns the rounding of a ResNet's ~0 gradient elements into lr-sized moves
        opt = torch.optim.SGD(model.parameters(), lr=SGD_LR)
    losses = []
    grads: dict[str, torch.Tensor] = {}
    stats: dict[str, torch.Tensor] = {}
    for step in range(pixels.shape[0]):
        loss = _loss(model(pixel_values=pixels[step], labels=labels[step]))
        opt.zero_grad()
        loss.backward()
        if step == 0:
            grads, stats = _gradients(model), _buffers(model)
        opt.step()
        losses.append(float(loss))
    return losses, grads, stats


def _gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    if isinstance(model, AutoParallelGraph):
        return model.full_gradients()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _picked(groups: list[OperatorGroup], cost: CostModel,
            pick: Callable[[OperatorGroup, set[str]], set[str]]) -> DagPlan:  # fmt: skip
    graph = transformer_graph(groups, cost)
    picks = []
    for node, group, meg in zip(graph.nodes, groups, megatron_assignment(groups), strict=True):
        wanted = pick(group, meg)
        picks.append(next(i for i, s in enumerate(node.strategies) if s.name in wanted))
    return evaluate(graph, picks, cost)


def _ilp(groups: list[OperatorGroup], cost: CostModel, wanted: set[tuple[str, str]]) -> DagPlan:
    """The ILP's optimum at 90 % of the data-parallel memory, checked to mix ``dp`` with every
    ``(operator kind, strategy)`` of ``wanted``."""
    budget = 0.9 * family_plan("dp", groups, cost).memory
    plan = search_free(groups, cost, budget)
    kinds = {g.name: g.kind for g in groups}
    found = {(kinds[n], s.name) for n, s in zip(plan.nodes, plan.strategies, strict=True)}
    assert wanted <= found and any(name == "dp" for _, name in found), found  # really mixed
    return plan


def _buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    if isinstance(model, AutoParallelGraph):
        return model.full_buffers()
    return {n: b.detach().clone() for n, b in model.named_buffers()}


def _check(
    kind: str, name: str, model: AutoParallelGraph, base: torch.nn.Module,
    pixels: torch.Tensor, labels: torch.Tensor,
) -> None:  # fmt: skip
    reference = copy.deepcopy(base)
    before = snapshot(reference)
    ref_losses, ref_grads, ref_stats = _train(kind, reference, pixels, labels)
    assert min(float(g.abs().max()) for g in ref_grads.values()) > 10 * GRAD_TOLS[kind]
    if dist.get_rank() == 0:
        model.print_plan()
    losses, grads, stats = _train(kind, model, pixels, labels)
    for param_name, want in ref_grads.items():
        label = f"{kind} {name} gradient of {param_name}: "
        torch.testing.assert_close(grads[param_name], want, atol=GRAD_TOLS[kind], rtol=0,
                                   msg=label.__add__)  # fmt: skip
    for buf_name, want in ref_stats.items():
        label = f"{kind} {name} buffer {buf_name} after one step: "
        torch.testing.assert_close(stats[buf_name], want, atol=STAT_TOL, rtol=0,
                                   msg=label.__add__)  # fmt: skip
    assert_run_matches(losses, ref_losses, model.full_state_dict(), reference, before,
                       loss_atol=TOL, param_atol=PARAM_TOLS[kind],
                       label=f"{kind} {name}")  # fmt: skip
    final, ref_final = _buffers(model), _buffers(reference)
    for buf_name, want in ref_final.items():
        label = f"{kind} {name} buffer {buf_name} at the end: "
        torch.testing.assert_close(final[buf_name], want, atol=10 * STAT_TOL, rtol=0,
                                   msg=label.__add__)  # fmt: skip


def _class_parallel(group: OperatorGroup, megatron: set[str]) -> set[str]:
    """Data parallel up to the classifier, which splits the classes (``col``) for the
    class-parallel cross entropy (``F`` logits, whole labels)."""
    if group.name == "classifier":
        return {"col"}
    if group.kind == "loss" or group.name == "labels":
        return {"F"} if group.kind == "loss" else {"R"}
    return {"B", "dp"}


@distributed(2)
def test_vit_graph_plans_train_like_one_process() -> None:
    cost = CostModel(world_size=2, **COST)
    torch.manual_seed(0)
    base = _vit()
    batch = 16
    pixels = torch.randn(STEPS, batch, 3, 8, 8)
    labels = torch.randint(0, CLASSES, (STEPS, batch))
    meta = {
        "pixel_values": torch.empty(batch, 3, 8, 8, device="meta"),
        "labels": torch.empty(batch, dtype=torch.long, device="meta"),
    }
    groups = trace_operators(_vit(), meta)
    graph = transformer_graph(groups, cost)
    mesh = init_device_mesh("cpu", (2,))
    plans = {
        "megatron": _picked(groups, cost, lambda group, meg: meg),
        "class_parallel": _picked(groups, cost, _class_parallel),
        "ilp": _ilp(groups, cost, {("conv", "col"), ("linear", "col"), ("linear", "row")}),
    }
    for name, plan in plans.items():
        model = apply_graph_plan(copy.deepcopy(base), meta, groups, plan, graph, mesh)
        _check("vit", name, model, base, pixels, labels)


@distributed(2)
def test_resnet_graph_plans_train_like_one_process() -> None:
    cost = CostModel(world_size=2, **COST)
    resnet = _resnet_class()
    torch.manual_seed(0)
    base = _Classifier(resnet())
    batch, image = 8, 16
    pixels = torch.randn(STEPS, batch, 3, image, image)
    labels = torch.randint(0, 10, (STEPS, batch))
    meta = {
        "pixel_values": torch.empty(batch, 3, image, image, device="meta"),
        "labels": torch.empty(batch, dtype=torch.long, device="meta"),
    }
    groups = trace_operators(_Classifier(resnet()), meta)
    graph = transformer_graph(groups, cost)
    mesh = init_device_mesh("cpu", (2,))
    plans = {
        "dp": _picked(groups, cost, lambda group, meg: {"B", "dp"}),
        "ilp": _ilp(groups, cost, {("conv", "col"), ("batchnorm", "F"), ("batchnorm", "B")}),
    }
    for name, plan in plans.items():
        model = apply_graph_plan(copy.deepcopy(base), meta, groups, plan, graph, mesh)
        _check("resnet", name, model, base, pixels, labels)


@distributed(2)
def test_autoparallelize_runs_a_resnet_through_the_graph_executor() -> None:
    """A model outside ``transformers`` that is not an MLP chain goes to the graph path: data
    parallel without a budget, the ILP's mixed plan below data parallelism's memory."""
    cost = CostModel(world_size=2, **COST)
    resnet = _resnet_class()
    torch.manual_seed(0)
    base = _Classifier(resnet())
    batch, image = 8, 16
    pixels = torch.randn(STEPS, batch, 3, image, image)
    labels = torch.randint(0, 10, (STEPS, batch))
    meta = {
        "pixel_values": torch.empty(batch, 3, image, image, device="meta"),
        "labels": torch.empty(batch, dtype=torch.long, device="meta"),
    }
    groups = trace_operators(_Classifier(resnet()), meta)
    dp_mem = family_plan("dp", groups, cost).memory
    for family, budget in (("dp", None), ("mixed", 0.9 * dp_mem)):
        model = autoparallelize(copy.deepcopy(base), meta, memory_budget=budget, cost_model=cost)
        assert isinstance(model, AutoParallelGraph) and model.family == family, model.family
        _check("resnet", family, model, base, pixels, labels)
