"""Building a pipelined model with the legacy API, without a process group: the partition
helpers' documented return shape (Colossal-AI's values), every documented import path,
``build_pipeline_model`` / ``build_pipeline_model_from_cfg`` / ``ModelFromConfig``, and
``PipelinableContext`` (its stages, run one after the other, compute the whole model)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.nn as nn

from kolossos.legacy.builder import (
    ModelFromConfig,
    build_layer,
    build_pipeline_model,
    build_pipeline_model_from_cfg,
)
from kolossos.legacy.builder.pipeline import partition_balanced, partition_uniform
from kolossos.legacy.registry import LAYERS, MODELS
from kolossos.pipeline.pipelinable import PipelinableContext, PipelinableModel


def test_partition_uniform_returns_per_rank_chunk_ranges_as_upstream() -> None:
    # per rank, one (start, end) per chunk; chunk by chunk, later stages take the extra layers
    assert partition_uniform(8, 2, 2) == [[(0, 2), (4, 6)], [(2, 4), (6, 8)]]
    assert partition_uniform(10, 2, 2) == [[(0, 2), (5, 7)], [(2, 5), (7, 10)]]
    assert partition_uniform(5, 2, 1) == [[(0, 2)], [(2, 5)]]
    assert partition_uniform(24, 4, 1) == [[(0, 6)], [(6, 12)], [(12, 18)], [(18, 24)]]
    parts = partition_uniform(12, 2, 1)
    first, last = parts[0][0], parts[-1][-1]
    assert first[0] == 0 and last[1] == 12  # start == 0: first stage; end == n: last stage


def test_partition_balanced_balances_parameters_with_the_same_shape() -> None:
    assert partition_balanced([1, 1, 1, 9], 2, 1) == [[(0, 3)], [(3, 4)]]
    # chunks go round the ranks: rank 0 holds virtual stages 0 and 2
    parts = partition_balanced([4, 4, 1, 1, 1, 1, 4, 4], 2, 2)
    assert [len(p) for p in parts] == [2, 2]
    flat = sorted(r for p in parts for r in p)
    assert flat[0][0] == 0 and flat[-1][1] == 8
    assert all(a[1] == b[0] for a, b in itertools.pairwise(flat))
    assert parts[0][0] == flat[0] and parts[1][0] == flat[1] and parts[0][1] == flat[2]


def test_documented_import_paths_resolve_to_one_implementation() -> None:
    import kolossos.builder as old_builder
    import kolossos.builder.pipeline as old_pipeline
    import kolossos.legacy.builder.pipeline as legacy_pipeline
    import kolossos.legacy.pipeline as legacy_pp
    from kolossos.legacy.pipeline.pipelinable import PipelinableContext as LegacyCtx
    from kolossos.nn.layer.wrapper import PipelineSharedModuleWrapper
    from kolossos.nn.model import ModelFromConfig as AliasModel
    from kolossos.registry import LAYERS as OLD_LAYERS
    from kolossos.registry import MODELS as OLD_MODELS

    assert old_builder.build_pipeline_model is build_pipeline_model
    assert old_builder.build_pipeline_model_from_cfg is build_pipeline_model_from_cfg
    assert old_pipeline.partition_uniform is legacy_pipeline.partition_uniform
    assert old_pipeline.partition_balanced is partition_balanced
    assert legacy_pp.PipelinableContext is LegacyCtx is PipelinableContext
    assert AliasModel is ModelFromConfig
    assert PipelineSharedModuleWrapper.__module__ == "kolossos.legacy.nn.wrapper"
    assert OLD_LAYERS is LAYERS and OLD_MODELS is MODELS


def test_build_pipeline_model_without_a_pipeline_keeps_everything() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    stage = build_pipeline_model(model, num_chunks=1, verbose=True)
    assert list(stage.state_dict()) == list(model.state_dict())
    chunks = build_pipeline_model(model, num_chunks=3)
    assert isinstance(chunks, nn.ModuleList) and [len(c) for c in chunks] == [1, 1, 1]
    with pytest.raises(ValueError, match="num_chunks=0"):
        build_pipeline_model(model, num_chunks=0)


class _Mlp(ModelFromConfig):
    """The docs' ModelFromConfig example, small."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers_cfg = [dict(type="Linear", in_features=3, out_features=width)]
        for _ in range(depth):
            self.layers_cfg += [dict(type="Tanh"), dict(type="Linear", in_features=width,
                                                        out_features=width)]  # fmt: skip


if not MODELS.has("_Mlp"):
    MODELS.register_module(_Mlp)


def test_build_from_cfg_gives_the_unsplit_models_weights() -> None:
    torch.manual_seed(0)
    whole = _Mlp(8, 2)
    whole.build_from_cfg()
    torch.manual_seed(0)
    for method in ("layer", "parameter", "uniform", "balanced"):
        torch.manual_seed(0)
        stage = build_pipeline_model_from_cfg(dict(type="_Mlp", width=8, depth=2), 1, method)
        assert isinstance(stage, _Mlp) and stage.layer_range == (0, 5)
        for (n1, p1), (n2, p2) in zip(stage.named_parameters(), whole.named_parameters(),
                                      strict=True):  # fmt: skip
            assert n1 == n2 and torch.equal(p1, p2)
    x = torch.randn(4, 3)
    torch.testing.assert_close(stage(x), whole(x))
    chunks = build_pipeline_model_from_cfg(dict(type="_Mlp", width=8, depth=2), 2, "layer")
    assert [c.layer_range for c in chunks] == [(0, 2), (2, 5)]
    with pytest.raises(ValueError, match="partition_method='greedy' is unknown"):
        build_pipeline_model_from_cfg(dict(type="_Mlp", width=8, depth=2), 1, "greedy")
    with pytest.raises(TypeError, match="is not a ModelFromConfig"):
        if not MODELS.has("PlainNet"):
            MODELS.register_module(type("PlainNet", (nn.Linear,), {}))
        build_pipeline_model_from_cfg(dict(type="PlainNet", in_features=2, out_features=2))
    with pytest.raises(NameError, match="'Nope' is not in the registry"):
        build_layer(dict(type="Nope"))
    with pytest.raises(ValueError, match="out of range"):
        _Mlp(4, 1).build_from_cfg(2, 9)
    with pytest.raises(RuntimeError, match="has no layers"):
        _Mlp(4, 1)(x)


class _Tiny(nn.Module):
    """A ResNet-shaped model: stem, two blocks, pool, then a flatten the forward does inline."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.relu = nn.ReLU()
        self.layer1 = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.Tanh())
        self.layer2 = nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.Tanh())
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.layer2(self.layer1(self.relu(self.conv1(x)))))
        return self.fc(torch.flatten(x, 1))


EXEC_SEQ: list[Any] = ["conv1", "relu", "layer1", "layer2", "avgpool",
                       (lambda x: torch.flatten(x, 1), "behind"), "fc"]  # fmt: skip


def _run(stages: list[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for stage in stages:
        x = stage(x)
    return x


@pytest.mark.parametrize("policy", ["balanced", "uniform"])
@pytest.mark.parametrize("pp_size", [1, 2, 3])
def test_pipelinable_stages_compose_to_the_whole_model(policy: str, pp_size: int) -> None:
    ctx = PipelinableContext()
    ctx.policy = policy
    with ctx:
        model = _Tiny()
    assert ctx.model is model and ctx.policy == policy
    ctx.to_layer_list(EXEC_SEQ)
    assert ctx.layers_count == 6 and ctx.funcs_count == 1
    stages = [ctx.partition(1, pp_size, r) for r in range(pp_size)]
    assert all(isinstance(s, PipelinableModel) for s in stages)
    assert [n for s in stages for n in s.layer_names] == ctx.layer_names
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(_run(stages, x), model(x))
    # the stages hold the model's own parameters, under its names
    named = {k: v for s in stages for k, v in s.named_layer_parameters().items()}
    assert named.keys() == dict(model.named_parameters()).keys()
    assert all(named[k] is v for k, v in model.named_parameters())


def test_pipelinable_chunks_customized_and_default_sequences() -> None:
    ctx = PipelinableContext(policy="uniform")
    with ctx:
        model = _Tiny()
    ctx.to_layer_list(EXEC_SEQ)
    chunks = [ctx.partition(2, 2, r) for r in range(2)]  # virtual stage c * 2 + r
    assert all(isinstance(c, nn.ModuleList) and len(c) == 2 for c in chunks)
    order = [chunks[0][0], chunks[1][0], chunks[0][1], chunks[1][1]]
    x = torch.randn(2, 3, 8, 8)
    torch.testing.assert_close(_run(order, x), model(x))
    ctx.policy = "customized"
    ctx.to_layer_list(["conv1", "relu", "layer1", "SPLIT_NODE", "layer2", "avgpool",
                       torch.nn.Flatten(1).forward, "fc"])  # fmt: skip
    assert ctx.partition(1, 2, 1).layer_names == ["layer2", "avgpool", "fc"]
    ctx.policy = {0: [(0, 1)], 1: [(1, 6)]}
    assert ctx.partition(1, 2, 0).layer_names == ["conv1"]
    ctx.to_layer_list()  # default: the children, containers expanded
    assert ctx.layer_names[:4] == ["conv1", "relu", "layer1.0", "layer1.1"]


def test_pipelinable_passes_keyword_inputs_to_the_layers_that_take_them() -> None:
    class Embed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 4)

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            return self.emb(input_ids)

    class Masked(nn.Module):
        def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
            return x * attention_mask[..., None]

    ctx = PipelinableContext(policy="uniform")
    with ctx:
        model = nn.Sequential(Embed(), Masked())
    ctx.to_layer_list()
    ids, mask = torch.tensor([[1, 2, 3]]), torch.tensor([[1.0, 0.0, 1.0]])
    first, last = ctx.partition(1, 2, 0), ctx.partition(1, 2, 1)
    out = last(first(input_ids=ids, attention_mask=mask), attention_mask=mask)
    torch.testing.assert_close(out, model[1](model[0](ids), mask))
