"""Planning for the timm-style Bottleneck ResNet of
``test_auto_parallel_tracer_models`` with a cross-entropy loss, 2 ranks, no process group.

The ATen graph groups into convolutions, BatchNorms, ReLUs (one operator per call of a block's
shared ``act``), max pool, residual adds, the average pool (with its ``flatten``), the linear
head and the loss; every FLOP and parameter byte lands in one operator. Convolutions get ``dp`` /
``col`` / ``rep``, BatchNorms ``B`` / ``R`` / ``F`` (channels sharded), pools and ReLUs ``B`` /
``R`` / ``F``. The whole-graph ILP plans it: without a budget every convolution data parallel; at a
budget below data parallelism's memory it shards some convolutions' output
channels with their BatchNorms. The graph executor runs these plans (BatchNorms under ``B``
with synchronised statistics): ``tests/parity/test_autoparallelize_graph_vision.py``.
"""

from __future__ import annotations

import pytest
import torch
from test_auto_parallel_tracer_models import _ResNet

from kolossos.auto_parallel import ColoTracer, CostModel
from kolossos.auto_parallel.autoparallelize import build_chain
from kolossos.auto_parallel.module_graph import build_module_graph
from kolossos.auto_parallel.strategies import UnsupportedOperatorError
from kolossos.auto_parallel.transformer_plan import family_plan, format_dag_plan, search_free
from kolossos.auto_parallel.transformer_strategies import transformer_graph

BATCH = 8
COST = CostModel(world_size=2, flops_per_s=1e9, alpha=1e-6, beta=1e-8)


class _Classifier(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = _ResNet()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.net(x), labels)


def _groups():
    torch.manual_seed(0)
    model = _Classifier()
    meta = {
        "x": torch.empty(BATCH, 3, 32, 32, device="meta"),
        "labels": torch.empty(BATCH, dtype=torch.long, device="meta"),
    }
    traced = ColoTracer(backend="export").trace(model, meta)
    return model, traced, build_module_graph(traced, model, list(meta))


def test_resnet_operator_graph() -> None:
    model, traced, groups = _groups()
    kinds = [g.kind for g in groups]
    assert kinds.count("conv") == 15 and kinds.count("batchnorm") == 15
    assert kinds.count("add") == 4 and kinds.count("linear") == 1 and kinds[-1] == "loss"
    types = [g.module_type for g in groups if g.kind == "elementwise"]
    assert types.count("ReLU") == 1 + 4 * 3 and types.count("MaxPool2d") == 1
    assert types.count("AdaptiveAvgPool2d") == 1
    by_name = {g.name: g for g in groups}
    block = "net.layer1.0"
    assert by_name[f"{block}.add"].inputs == [f"{block}.bn3", f"{block}.downsample.1"]
    assert by_name[f"{block}.act#2"].inputs == [f"{block}.add"]  # the block's third ReLU call
    assert by_name["net.layer1.1.add"].inputs == ["net.layer1.1.bn3", f"{block}.act#2"]
    assert by_name["net.global_pool"].nodes == ["adaptive_avg_pool2d", "flatten"]
    assert by_name["loss"].inputs == ["net.fc", "labels"]
    assert sum(g.flops for g in groups) == traced.total_flops
    assert sum(g.param_bytes for g in groups) == 4 * sum(p.numel() for p in model.parameters())


def test_resnet_strategies_and_ilp_plan() -> None:
    _, _, groups = _groups()
    graph = transformer_graph(groups, COST)
    names = {n.name: sorted(s.name for s in n.strategies) for n in graph.nodes}
    assert names["net.layer2.0.conv2"] == ["col", "dp", "rep"]
    assert names["net.layer2.0.bn2"] == ["B", "F", "R"]
    assert names["net.maxpool"] == names["net.global_pool"] == ["B", "F", "R"]
    bn = {s.name: s for s in graph.nodes[[n.name for n in graph.nodes].index("net.bn1")].strategies}
    assert bn["F"].param_mem == bn["R"].param_mem / 2  # channels sharded with their weights
    dp = family_plan("dp", groups, COST)
    free = search_free(groups, COST)
    print(format_dag_plan(free, graph))
    assert free.step_time <= dp.step_time
    chosen = dict(zip(free.nodes, free.names, strict=True))
    assert all(chosen[g.name] == "dp" for g in groups if g.kind == "conv")
    budget = 0.9 * dp.memory  # below data parallelism's memory: shard channels
    lean = search_free(groups, COST, budget)
    print(format_dag_plan(lean, graph))
    assert lean.memory <= budget
    chosen = dict(zip(lean.nodes, lean.names, strict=True))
    assert any(chosen[g.name] == "col" for g in groups if g.kind == "conv")
    assert any(chosen[g.name] == "F" for g in groups if g.kind == "batchnorm")


def test_resnet_is_not_a_chain() -> None:
    """The MLP chain's strategies do not cover convolutions: ``build_chain`` names the first,
    and ``autoparallelize`` then takes the operator-graph path (the graph executor)."""
    x = torch.empty(BATCH, 3, 32, 32, device="meta")
    with pytest.raises(
        UnsupportedOperatorError, match=r"node 'conv1' \(op call_module, operator Conv2d\)"
    ):
        build_chain(_ResNet(), {"x": x}, COST)
