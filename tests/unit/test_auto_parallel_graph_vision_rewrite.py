"""The graph executor's vision pieces without a process group: the feature dimension of a
convolution (channels) followed through ViT's patch ``flatten``/``transpose``, the CLS token's
batch dimension, a ResNet rank's local shapes under column-parallel convolutions and
channel-sharded BatchNorms (weights and running statistics), the price of a batch-sharded
BatchNorm's synchronised statistics, and the write-back of the buffer mutations a
functionalised graph returns as outputs."""

from __future__ import annotations

import copy

import torch
from test_auto_parallel_tracer_models import _ResNet
from torch import fx, nn

from kolossos.auto_parallel import CostModel
from kolossos.auto_parallel.apply_graph import export_model
from kolossos.auto_parallel.graph_rewrite import GraphRewriter
from kolossos.auto_parallel.module_graph import OperatorGroup, build_module_graph
from kolossos.auto_parallel.shard_dims import base_name
from kolossos.auto_parallel.sharding_graph import evaluate
from kolossos.auto_parallel.traced_graph import TracedGraph, node_info
from kolossos.auto_parallel.transformer_strategies import transformer_graph

COST = {"flops_per_s": 1e9, "alpha": 1e-6, "beta": 1e-8}


class _Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = _ResNet()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.net(x), labels)


def _vit() -> nn.Module:
    import transformers as tf

    config = tf.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=32,
                          num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                          num_labels=5, qkv_bias=False)  # fmt: skip
    return tf.ViTForImageClassification(config)


def _rewriter(
    model: nn.Module,
    samples: dict[str, torch.Tensor],
    pick: dict[str, set[str]],
    world: int = 2,
    program: torch.export.ExportedProgram | None = None,
) -> tuple[GraphRewriter, list[OperatorGroup]]:
    """A rank-0 rewriter of ``model`` where operator kinds take the strategies ``pick`` names
    (``"*"``: the rest)."""
    cost = CostModel(world_size=world, **COST)
    exported, traced = export_model(model, samples)
    if program is not None:
        gm = program.graph_module
        infos = [node_info(n, gm) for n in gm.graph.nodes]
        traced = TracedGraph(graph_module=gm, nodes=infos, backend="export")
        exported = program
    groups = build_module_graph(traced, model, list(samples))
    graph = transformer_graph(groups, cost)
    picks = []
    for node, group in zip(graph.nodes, groups, strict=True):
        wanted = pick.get(group.kind, pick["*"])
        picks.append(next(i for i, s in enumerate(node.strategies) if s.name in wanted))
    plan = evaluate(graph, picks, cost)
    strategies = dict(zip(plan.nodes, plan.strategies, strict=True))
    return GraphRewriter(exported, groups, strategies, model, world, 0, None), groups  # type: ignore[arg-type]


def test_vit_patch_channels_and_cls_token_dimensions() -> None:
    samples = {"pixel_values": torch.empty(4, 3, 8, 8), "labels": torch.empty(4, dtype=torch.long)}
    rewriter, _ = _rewriter(_vit(), samples, {"*": {"B", "dp"}})
    nodes = list(rewriter.nodes.values())
    conv = next(n for n in nodes if base_name(n) == "conv2d")
    flat = next(n for n in nodes if base_name(n) == "flatten")
    moved = next(iter(flat.users))
    # [b, hidden, 2, 2] -> flatten(2) -> [b, hidden, 4] -> transpose(1, 2) -> [b, 4, hidden]
    assert rewriter.dims["F"][conv.name] == 1 and rewriter.dims["F"][flat.name] == 1
    assert base_name(moved) == "transpose" and rewriter.dims["F"][moved.name] == 2
    # the CLS token [1, 1, hidden] expanded over the batch starts a batch dimension
    expand = next(n for n in nodes if base_name(n) == "expand")
    assert rewriter.dims["B"][expand.name] == 0


def test_resnet_local_shapes_under_column_convs_and_channel_batchnorms() -> None:
    torch.manual_seed(0)
    model = _Classifier()
    full = copy.deepcopy(model)
    samples = {"x": torch.empty(4, 3, 16, 16), "labels": torch.empty(4, dtype=torch.long)}
    pick = {"conv": {"col"}, "batchnorm": {"F"}, "elementwise": {"F"}, "add": {"F"},
            "linear": {"row"}, "*": {"R"}}  # fmt: skip
    rewriter, _ = _rewriter(model, samples, pick)
    _, params, specs, constants = rewriter.rewrite()
    conv = specs["net.layer1.0.conv2.weight"]
    assert conv.dim == 0 and params[conv.attr].shape == (2, 4, 3, 3)  # 4 output channels / 2
    bn = specs["net.layer1.0.bn2.weight"]
    assert bn.dim == 0 and params[bn.attr].shape == (2,)
    fc = specs["net.fc.weight"]  # row-parallel head: input features split
    assert fc.dim == 1 and params[fc.attr].shape == (10, 16)
    stats = rewriter.buffer_specs["net.layer1.0.bn2.running_var"]
    assert stats.dim == 0
    torch.testing.assert_close(constants[stats.attr], full.net.layer1[0].bn2.running_var[:2])
    assert rewriter.buffer_specs["net.layer1.0.bn2.num_batches_tracked"].dim is None


def test_batch_sharded_batchnorm_prices_its_statistics() -> None:
    """``B`` pays two all-reduces forward (channel sums with the count, squared deviations)
    and one backward (two per-channel sums) on top of its gradient's share."""
    samples = {"x": torch.empty(8, 3, 16, 16), "labels": torch.empty(8, dtype=torch.long)}
    _, traced = export_model(_Classifier(), samples)
    groups = build_module_graph(traced, _Classifier(), list(samples))
    cost = CostModel(world_size=2, **COST)
    graph = transformer_graph(groups, cost)
    at = [g.name for g in groups].index("net.layer2.0.bn3")
    group, node = groups[at], graph.nodes[at]
    channels = 32 * 4.0
    assert group.bias_bytes == channels
    strategies = {s.name: s for s in node.strategies}
    grad_sync = cost.ring_bytes(group.param_bytes) + 2 * cost.copy_byte_s * group.param_bytes
    stats = (
        cost.all_reduce(channels + 4) + cost.all_reduce(channels) + cost.all_reduce(2 * channels)
    )
    assert strategies["B"].comm_s == grad_sync + stats
    assert strategies["R"].comm_s == strategies["F"].comm_s == 0.0


def test_buffer_mutations_returned_by_a_functional_graph_are_written_back() -> None:
    """``run_decompositions({})`` functionalises the BatchNorms: their new running statistics
    become graph outputs listed in ``buffers_to_mutate``; the rewritten graph writes them into
    the buffers and returns the loss alone, as the eager model updates its own."""
    torch.manual_seed(0)
    model = _Classifier()
    eager = copy.deepcopy(model)
    samples = {"x": torch.empty(4, 3, 16, 16), "labels": torch.empty(4, dtype=torch.long)}
    program, _ = export_model(model, samples)
    program = program.run_decompositions({})
    assert len(program.graph_signature.buffers_to_mutate) == 45  # 15 BatchNorms x 3
    rewriter, _ = _rewriter(model, samples, {"*": {"R", "rep"}}, world=1, program=program)
    graph, params, _, constants = rewriter.rewrite()
    holder = nn.Module()
    for attr, tensor in params.items():
        holder.register_parameter(attr, nn.Parameter(tensor))
    for attr, tensor in constants.items():
        holder.register_buffer(attr, tensor)
    x, labels = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    (loss,) = fx.GraphModule(holder, graph)(x, labels)
    torch.testing.assert_close(loss, eager(x, labels))
    for (name, got), (_, want) in zip(model.named_buffers(), eager.named_buffers(), strict=True):
        torch.testing.assert_close(got, want, msg=f"{name} not written back".__add__)
    assert int(model.net.bn1.num_batches_tracked) == 1
