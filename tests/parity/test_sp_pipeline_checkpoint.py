"""Checkpoints of HybridParallelPlugin under pp 2 x sp 2 (``'all_to_all'``) resume at the same
layout and at others.

A tiny GPT-2 (2 blocks, ``wte`` tied to ``lm_head`` across the stages) trains two steps at
pp 2 x sp 2 (4 ranks, dp 1); model and optimizer are saved with ``booster.save_model`` /
``booster.save_optimizer`` (sharded files), then training continues from the files in a fresh
boosted model at the same layout, at pp 2 x sp 2 with ``'ring_attn'`` (zig-zag shards), at
pp 2 x tp 2 with ``'split_gather'`` (tensor-parallel shards), and in one plain process. Two
more steps must give the same losses as the run that never stopped, and the same parameters.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from kolossos.booster import Booster
from kolossos.booster.plugin import HybridParallelPlugin
from kolossos.checkpoint_io import GeneralCheckpointIO, register_param_names
from kolossos.nn.layer.parallel_1d import gather_tp_full, get_tp_spec
from kolossos.testing import distributed
from kolossos.testing.parity import shard

pytestmark = pytest.mark.dist

SEQ, BATCH, MICRO = 16, 4, 2
# fp32: the continuations differ only in the order of sums (SP / TP shards, micro-batches).
TOL = 1e-5


@pytest.fixture(scope="module")
def build() -> Callable[[], nn.Module]:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=100, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4, attn_pdrop=0.0,
        resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return lambda: transformers.GPT2LMHeadModel(config)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, eps=1e-6)


def batches(n: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(11)
    out = []
    for _ in range(n):
        ids = torch.randint(2, 100, (BATCH, SEQ), generator=gen)
        out.append({"input_ids": ids, "labels": ids})
    return out


class Run:
    """A pipelined boosted GPT-2 (dp 1: every rank gets the whole batch)."""

    def __init__(self, template: nn.Module, **kwargs: Any) -> None:
        model = copy.deepcopy(template)
        self.plugin = HybridParallelPlugin(
            pp_size=2, num_microbatches=MICRO, precision="fp32", enable_sequence_parallelism=True,
            **({"tp_size": 1} | kwargs),
        )  # fmt: skip
        assert self.plugin.mesh.dp_size == 1
        self.booster = Booster(plugin=self.plugin)
        self.model, self.opt, *_ = self.booster.boost(model, adamw(model))

    def step(self, batch: dict[str, torch.Tensor]) -> float:
        """One update; the loss before it (the last stage's, on every rank)."""
        out = self.booster.execute_pipeline(iter([batch]), self.model, lambda o, _: o.loss,
                                            self.opt)  # fmt: skip
        self.opt.step()
        self.opt.zero_grad()
        held = out["loss"] is not None
        value = torch.tensor(
            [out["loss"].item() if held else 0.0, float(held)], dtype=torch.float64
        )
        dist.all_reduce(value)
        return (value[0] / value[1]).item()

    def params(self) -> dict[str, torch.Tensor]:
        mine = {}
        for chunk in self.model.chunks:
            for name, p in chunk.named_parameters():
                spec = get_tp_spec(p)
                mine[name] = gather_tp_full(p.detach(), spec) if spec is not None else p.detach()
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        return {n: v for part in everyone for n, v in part.items()}

    def save(self, root: Path) -> None:
        self.booster.save_model(self.model, str(root / "model"), shard=True,
                                size_per_shard=0.01, use_safetensors=True)  # fmt: skip
        self.booster.save_optimizer(self.opt, str(root / "optim"), shard=True, size_per_shard=0.01)

    def load(self, root: Path) -> Run:
        self.booster.load_model(self.model, str(root / "model"))
        self.booster.load_optimizer(self.opt, str(root / "optim"))
        return self


def plain(template: nn.Module, root: Path, data: list[dict[str, torch.Tensor]]) -> list[float]:
    """One process, no plugin: load the files, train on ``data`` (micro-batch means)."""
    model = copy.deepcopy(template)
    opt = adamw(model)
    register_param_names(opt, model)
    io = GeneralCheckpointIO()
    io.load_model(model, str(root / "model"))
    io.load_optimizer(opt, str(root / "optim"))
    losses = []
    for batch in data:
        loss = sum(model(**{k: shard(v, i, MICRO) for k, v in batch.items()}).loss
                   for i in range(MICRO)) / MICRO  # fmt: skip
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@distributed(4)
def test_pp2_sp2_checkpoint_resumes_at_other_layouts(
    build: Callable[[], nn.Module], tmp_path: Path
) -> None:
    torch.manual_seed(0)
    template = build()
    data = batches(4)
    sp = {"sp_size": 2, "sequence_parallelism_mode": "all_to_all"}
    run = Run(template, **sp)
    for batch in data[:2]:
        run.step(batch)
    run.save(tmp_path)
    continued = [run.step(batch) for batch in data[2:]]
    # the step between the two compared losses moves them by 10x the tolerance and more
    assert abs(continued[1] - run.step(data[3])) > 10 * TOL
    expected = run.params()

    layouts: list[dict[str, Any]] = [
        sp,
        {"sp_size": 2, "sequence_parallelism_mode": "ring_attn"},
        {"tp_size": 2, "sequence_parallelism_mode": "split_gather"},
    ]
    for layout in layouts:
        resumed = Run(template, **layout).load(tmp_path)
        losses = [resumed.step(batch) for batch in data[2:]]
        torch.testing.assert_close(losses, continued, rtol=TOL, atol=TOL, msg=str(layout))
        resumed.step(data[3])
        trained = resumed.params()
        assert trained.keys() == expected.keys()
        for name, value in trained.items():
            torch.testing.assert_close(value, expected[name], rtol=TOL, atol=TOL, msg=name)
    one_process = plain(template, tmp_path, data[2:])
    torch.testing.assert_close(one_process, continued, rtol=TOL, atol=TOL)
