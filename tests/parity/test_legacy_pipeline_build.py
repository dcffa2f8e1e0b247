"""Every documented way of building a pipelined model in the legacy generation trains like the
unsplit model (CPU/gloo): ``build_pipeline_model`` from an ``nn.Sequential`` (uniform),
``build_pipeline_model_from_cfg`` with a ``ModelFromConfig`` (``'layer'`` and ``'parameter'``,
i.e. balanced), ``PipelinableContext`` (balanced and uniform, with a ``(callable, "behind")``
entry), and hand-written per-stage modules (``gpc.is_first_rank(ParallelMode.PIPELINE)`` style,
fed a dict batch as keyword arguments, with a weight tied across the first and the last stage by
``PipelineSharedModuleWrapper``), each through ``kolossos.initialize`` + ``Engine``: on 2 and 4
pipeline ranks, with ``NUM_CHUNKS = 2`` (interleaved, on 2 and 4 ranks), and under 1D tensor
parallelism x pipeline 2 (4 ranks; ``TENSOR_SHAPE`` fixed, so no shapes travel, and each rank
sends half of every activation: ``scatter_gather_tensors``).

Several ways run in one spawned job (one launch). Each checks the last stage's loss at every step
against single-process training of the whole model on the same batches, every stage's parameters
at the end, and that training moved them far beyond the tolerance."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn

import kolossos
from kolossos.builder import build_pipeline_model, build_pipeline_model_from_cfg
from kolossos.builder.pipeline import partition_uniform
from kolossos.context import ParallelMode
from kolossos.core import global_context as gpc
from kolossos.engine.schedule import InterleavedPipelineSchedule, PipelineSchedule
from kolossos.nn.layer.parallel_1d import Linear1D_Col, Linear1D_Row
from kolossos.nn.layer.wrapper import PipelineSharedModuleWrapper
from kolossos.nn.model import ModelFromConfig
from kolossos.pipeline.pipelinable import PipelinableContext
from kolossos.registry import MODELS
from kolossos.testing import spawn
from kolossos.testing.parity import assert_moved, make_classification_batches, snapshot

pytestmark = pytest.mark.dist

D, W = 8, 16  # features = classes, hidden width
STEPS, BATCH, MICRO = 4, 16, 4
LR = 0.3
TOL = 2e-5

Named = dict[str, torch.Tensor]
#: a way returns (this rank's stage, the unsplit reference, stage name -> reference parameter)
Built = tuple[nn.Module, nn.Module, Callable[[], dict[str, tuple[torch.Tensor, torch.Tensor]]]]


class Block(nn.Module):
    """``tanh(linear(x))``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class CfgMlp(ModelFromConfig):
    """The docs' ModelFromConfig pattern: layer configs of unequal sizes."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.layers_cfg = [
            dict(type="Linear", in_features=D, out_features=width),
            dict(type="Tanh"),
        ]
        for _ in range(2):
            self.layers_cfg += [dict(type="Linear", in_features=width, out_features=width),
                                dict(type="Tanh")]  # fmt: skip
        self.layers_cfg.append(dict(type="Linear", in_features=width, out_features=D))


class Net(nn.Module):
    """A model built inside ``with pipelinable:`` (not a Sequential; its forward has a function
    call between two modules)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, W)
        self.body = nn.Sequential(nn.Linear(W, W), nn.Tanh(), nn.Linear(W, W), nn.Tanh())
        self.out = nn.Linear(W, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(torch.tanh(self.inp(x))))


EXEC_SEQ: list[Any] = ["inp", (torch.tanh, "behind"), "body.0", "body.1", "body.2", "body.3",
                       "out"]  # fmt: skip


class HandStage(nn.Module):
    """A hand-written stage taking a dict batch's entries as keyword arguments: the first stage
    reads ``x``, the others the previous stage's output; every stage applies ``mask``."""

    def __init__(self, layers: list[nn.Linear], first: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.first = first

    def forward(
        self, hidden_states: torch.Tensor | None = None, x: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        h = x if self.first else hidden_states
        assert h is not None and mask is not None
        for layer in self.layers:
            h = torch.tanh(layer(h)) * mask
        return h


class HandReference(nn.Module):
    """The unsplit hand-written model."""

    def __init__(self, layers: list[nn.Linear]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return HandStage(list(self.layers), True)(x=x, mask=mask)


def _pp() -> tuple[int, int]:
    return gpc.pipeline_parallel_size, gpc.get_local_rank(ParallelMode.PIPELINE)


def _chunks(stage: nn.Module) -> list[nn.Module]:
    return list(stage) if isinstance(stage, nn.ModuleList) else [stage]


# --- the ways of building -----------------------------------------------------------------------
def way_sequential(num_chunks: int) -> Built:
    model = nn.Sequential(*[Block() for _ in range(8)])
    reference = copy.deepcopy(model)
    stage = build_pipeline_model(model, num_chunks=num_chunks, verbose=True)
    ref = dict(reference.named_parameters())
    return (
        stage,
        reference,
        lambda: {n: (p, ref[n]) for c in _chunks(stage) for n, p in c.named_parameters()},
    )


def way_cfg(num_chunks: int, method: str) -> Built:
    if not MODELS.has("CfgMlp"):
        MODELS.register_module(CfgMlp)
    seed = torch.initial_seed()
    stage = build_pipeline_model_from_cfg(dict(type="CfgMlp", width=W), num_chunks, method)
    torch.manual_seed(seed)  # the unsplit model from the same seed: the same weights
    reference = CfgMlp(W)
    reference.build_from_cfg()
    ref = dict(reference.named_parameters())

    def pairs() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        out = {}
        for chunk in _chunks(stage):
            start = chunk.layer_range[0]
            for i, layer in enumerate(chunk.layers):
                for n, p in layer.named_parameters():
                    out[f"layers.{start + i}.{n}"] = (p, ref[f"layers.{start + i}.{n}"])
        return out

    return stage, reference, pairs


def way_pipelinable(num_chunks: int, policy: str) -> Built:
    pipelinable = PipelinableContext()
    pipelinable.policy = policy
    with pipelinable:
        model = Net()
    reference = copy.deepcopy(model)
    pipelinable.to_layer_list(EXEC_SEQ)
    stage = pipelinable.partition(num_chunks, *_pp())
    ref = dict(reference.named_parameters())
    return (
        stage,
        reference,
        lambda: {
            n: (p, ref[n]) for c in _chunks(stage) for n, p in c.named_layer_parameters().items()
        },
    )


def way_hand_written(tied: bool) -> Built:
    pp_size, pp_rank = _pp()
    layers = [nn.Linear(D, D) for _ in range(2 * pp_size)]
    reference = HandReference(copy.deepcopy(layers))
    if tied:  # one parameter in the reference, one copy on each of the first and last stage
        reference.layers[-1].weight = reference.layers[0].weight
    ((start, end),) = partition_uniform(len(layers), pp_size, 1)[pp_rank]
    stage = HandStage(layers[start:end], first=gpc.is_first_rank(ParallelMode.PIPELINE))
    if tied:
        wrapper = PipelineSharedModuleWrapper([0, pp_size - 1])
        if gpc.is_first_rank(ParallelMode.PIPELINE):
            wrapper.register_parameter(stage.layers[0].weight)
        if gpc.is_last_rank(ParallelMode.PIPELINE):
            wrapper.register_parameter(stage.layers[-1].weight)
    ref = dict(reference.named_parameters())
    if tied:
        ref[f"layers.{len(layers) - 1}.weight"] = reference.layers[0].weight

    def pairs() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {
            f"layers.{start + i}.{n}": (p, ref[f"layers.{start + i}.{n}"])
            for i, layer in enumerate(stage.layers)
            for n, p in layer.named_parameters()
        }

    return stage, reference, pairs


class TPBlock(nn.Module):
    """A 1D tensor-parallel MLP block (column then row linear) made from a dense one."""

    def __init__(self, dense: nn.Sequential) -> None:
        super().__init__()
        group = gpc.get_group(ParallelMode.PARALLEL_1D)
        self.col = Linear1D_Col.from_native_module(dense[0], group)
        self.row = Linear1D_Row.from_native_module(dense[2], group, parallel_input=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.row(torch.tanh(self.col(x))))


def way_tensor_parallel(num_chunks: int) -> Built:
    dense = [nn.Sequential(nn.Linear(D, W), nn.Tanh(), nn.Linear(W, D)) for _ in range(4)]
    reference = nn.Sequential(*[nn.Sequential(b, nn.Tanh()) for b in copy.deepcopy(dense)])
    model = nn.Sequential(*[TPBlock(b) for b in dense])
    stage = build_pipeline_model(model, num_chunks=num_chunks)
    tp, rank = (
        gpc.get_world_size(ParallelMode.PARALLEL_1D),
        gpc.get_local_rank(ParallelMode.PARALLEL_1D),
    )

    def part(t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.chunk(tp, dim=dim)[rank]

    def pairs() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        out = {}
        for chunk in _chunks(stage):
            for name, block in chunk.named_children():
                ref = reference[int(name)][0]
                out[f"{name}.col.weight"] = (block.col.weight, part(ref[0].weight, 0))
                out[f"{name}.col.bias"] = (block.col.bias, part(ref[0].bias, 0))
                out[f"{name}.row.weight"] = (block.row.weight, part(ref[2].weight, 1))
                out[f"{name}.row.bias"] = (block.row.bias, ref[2].bias)
        return out

    return stage, reference, pairs


# --- training -------------------------------------------------------------------------------
def _batches(dict_batch: bool) -> list[Any]:
    plain = make_classification_batches(STEPS, BATCH, d_in=D, classes=D)
    if not dict_batch:
        return plain
    gen = torch.Generator().manual_seed(1)
    masks = [(torch.rand(BATCH, D, generator=gen) > 0.2).float() for _ in plain]
    return [({"x": x, "mask": m}, y) for (x, y), m in zip(plain, masks, strict=True)]


def _reference_losses(model: nn.Module, batches: list[Any]) -> list[float]:
    sgd = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for data, label in batches:
        sgd.zero_grad()
        out = model(**data) if isinstance(data, dict) else model(data)
        loss = nn.functional.cross_entropy(out, label)
        loss.backward()
        sgd.step()
        losses.append(loss.item())
    return losses


def _check(way: str, built: Built, num_chunks: int, dict_batch: bool = False) -> dict[str, Any]:
    """Train the stage through kolossos.initialize + Engine and the reference in-process."""
    stage, reference, pairs = built
    before = snapshot({n: p for n, (p, _) in pairs().items()})
    batches = _batches(dict_batch)
    sgd = torch.optim.SGD(stage.parameters(), lr=LR, momentum=0.9)
    engine, loader, _, _ = kolossos.initialize(
        stage, sgd, nn.CrossEntropyLoss(), list(batches), verbose=False
    )
    kind = InterleavedPipelineSchedule if num_chunks > 1 else PipelineSchedule
    assert type(engine.schedule) is kind, (way, type(engine.schedule))
    engine.train()
    data, losses = iter(loader), []
    for _ in range(STEPS):
        engine.zero_grad()
        _, _, loss = engine.execute_schedule(data, return_output_label=False)
        engine.step()
        if gpc.is_last_rank(ParallelMode.PIPELINE):
            losses.append(loss.item())
    expected = _reference_losses(reference, batches)
    if gpc.is_last_rank(ParallelMode.PIPELINE):
        torch.testing.assert_close(
            losses, expected, rtol=TOL, atol=TOL, msg=lambda m: f"{way}: {m}"
        )
    after = {}
    for name, (param, want) in pairs().items():
        torch.testing.assert_close(param.detach(), want.detach(), rtol=TOL, atol=TOL,
                                   msg=lambda m, n=name: f"{way} {n}: {m}")  # fmt: skip
        after[name] = param
    assert_moved(before, after, TOL)
    stats = engine.schedule.last_p2p_stats
    return {"way": way, "params": len(after), "stats": stats}


def _job(rank: int, world_size: int, port: int, job: str) -> list[Any]:
    config: dict[str, Any] = dict(parallel=dict(pipeline=2), NUM_MICRO_BATCHES=MICRO)
    if job in ("pp4", "interleaved4"):
        config["parallel"] = dict(pipeline=4)
    if job in ("interleaved", "interleaved4"):
        config["NUM_CHUNKS"] = 2
    if job == "tp1d_pp2":
        config["parallel"] = dict(pipeline=2, tensor=dict(size=2, mode="1d"))
        config["TENSOR_SHAPE"] = (BATCH // MICRO, D)
    kolossos.launch(config, rank, world_size, "localhost", port, verbose=False)
    chunks = config.get("NUM_CHUNKS", 1)
    results = []

    def run(way: str, build: Callable[[], Built], dict_batch: bool = False) -> None:
        torch.manual_seed(1234)
        results.append(_check(way, build(), chunks, dict_batch))

    if job == "tp1d_pp2":
        run("tp1d_sequential", lambda: way_tensor_parallel(1))
        return results
    run("sequential_uniform", lambda: way_sequential(chunks))
    if job == "interleaved4":  # 8 stages: the 8-layer Sequential only
        return results
    run("cfg_layer", lambda: way_cfg(chunks, "layer"))
    run("pipelinable_uniform", lambda: way_pipelinable(chunks, "uniform"))
    if job == "interleaved":
        return results
    run("cfg_parameter", lambda: way_cfg(chunks, "parameter"))
    run("pipelinable_balanced", lambda: way_pipelinable(chunks, "balanced"))
    run("hand_written_tied_dict", lambda: way_hand_written(tied=True), dict_batch=True)
    return results


@pytest.mark.parametrize(
    ("job", "world_size"),
    [("pp2", 2), ("interleaved", 2), ("pp4", 4), ("interleaved4", 4), ("tp1d_pp2", 4)],
)
def test_each_way_of_building_trains_like_the_unsplit_model(job: str, world_size: int) -> None:
    results = spawn(_job, world_size, job=job)
    for rank_results in results:
        assert all(r["params"] > 0 for r in rank_results)
    if job == "tp1d_pp2":  # rank 0: first stage, tensor rank 0
        stats = results[0][0]["stats"]
        activation = (BATCH // MICRO) * D * 4  # one micro-batch's fp32 activation, in bytes
        assert stats.metadata_sent == 0  # TENSOR_SHAPE: no shape exchange
        assert stats.bytes_sent == MICRO * activation // 2  # half of each activation
