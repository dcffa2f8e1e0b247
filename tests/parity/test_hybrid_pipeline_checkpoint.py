"""Pipeline-parallel HybridParallelPlugin checkpoints resume at other pp / tp sizes and in one
process.

A tiny GPT-2 (4 blocks, ``wte`` tied to ``lm_head`` across the first and last stage) trains two
steps at pp 2 x tp 2 (and at pp 2 x dp 2 with ZeRO-1); model and optimizer are saved as sharded
files, then training continues four ways from the files: the same run, pp 1 x tp 1 (dp 4), pp 4,
and one plain process (no plugin; ``transformers.from_pretrained`` reads the same files, and a
single-file save holds the same tensors). The next step and the loss after it must agree.
"""

from __future__ import annotations

import copy
import json
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
from kolossos.testing import distributed, parameterize
from kolossos.testing.parity import global_mean, shard

SEQ, BATCH = 8, 4
# fp32 everywhere: the continuations differ only in the order of sums (TP all-reduces, micro-
# batch accumulation, ZeRO partitions), so losses agree to float32 rounding.
TOL = 1e-5


@pytest.fixture(scope="module")
def build() -> Callable[[], nn.Module]:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=100, n_positions=SEQ, n_embd=32, n_layer=4, n_head=4,
        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return lambda: transformers.GPT2LMHeadModel(config)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1, eps=1e-6)


def batches(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(2, 100, (BATCH, SEQ), generator=gen) for _ in range(n)]


def lm_loss(outputs: Any, inputs: Any) -> torch.Tensor:
    return outputs.loss


class Run:
    """A boosted model and optimizer with a ``step`` (one update on a global batch) and a
    ``loss`` (global mean loss of a batch), for pipelined and unpipelined plugins alike."""

    def __init__(self, template: nn.Module, **kwargs: Any) -> None:
        model = copy.deepcopy(template)
        self.plugin = HybridParallelPlugin(precision="fp32", **({"tp_size": 1} | kwargs))
        self.booster = Booster(plugin=self.plugin)
        self.model, self.opt, *_ = self.booster.boost(model, adamw(model))
        self.pp = self.plugin.pp_size > 1

    def _mine(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        mesh = self.plugin.mesh
        part = shard(ids, mesh.dp_rank, mesh.dp_size)
        return {"input_ids": part, "labels": part}

    def _pipeline_loss(self, ids: torch.Tensor) -> float:
        out = self.booster.execute_pipeline(iter([self._mine(ids)]), self.model, lm_loss, self.opt)
        value = torch.tensor([0.0 if out["loss"] is None else out["loss"].item()])
        dist.all_reduce(value)  # one loss per last-stage rank (dp x tp of them)
        return value.item() / (self.plugin.mesh.dp_size * self.plugin.tp_size)

    def step(self, ids: torch.Tensor) -> None:
        if self.pp:
            self._pipeline_loss(ids)
        else:
            batch = self._mine(ids)
            self.booster.backward(self.model(**batch).loss, self.opt)
        self.opt.step()
        self.opt.zero_grad()

    def loss(self, ids: torch.Tensor) -> float:
        if self.pp:  # a pipeline step always runs backward: drop its gradients
            value = self._pipeline_loss(ids)
            self.opt.zero_grad()
            return value
        with torch.no_grad():
            return global_mean(self.model(**self._mine(ids)).loss)

    def save(self, root: Path) -> None:
        # tiny shards: the model spans several files, streamed one by one
        self.booster.save_model(self.model, str(root / "model"), shard=True,
                                size_per_shard=0.01, use_safetensors=True)  # fmt: skip
        self.booster.save_optimizer(self.opt, str(root / "optim"), shard=True, size_per_shard=0.01)
        self.booster.save_model(self.model, str(root / "whole.bin"))  # one file: streamed

    def load(self, root: Path) -> Run:
        self.booster.load_model(self.model, str(root / "model"))
        self.booster.load_optimizer(self.opt, str(root / "optim"))
        return self


def plain_continuation(template: nn.Module, root: Path, ids: list[torch.Tensor]) -> float:
    """One process, no plugin: load, step on ``ids[0]``, loss on ``ids[1]``."""
    transformers = pytest.importorskip("transformers")
    plain = copy.deepcopy(template)
    opt = adamw(plain)
    register_param_names(opt, plain)
    io = GeneralCheckpointIO()
    io.load_model(plain, str(root / "model"))
    io.load_optimizer(opt, str(root / "optim"))
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(root / "model"))
    for name, value in hf.state_dict().items():
        torch.testing.assert_close(value, plain.state_dict()[name], rtol=0, atol=0)
    whole = torch.load(root / "whole.bin", weights_only=True)
    assert whole.keys() == plain.state_dict().keys() - {"lm_head.weight"}
    for name, value in whole.items():
        torch.testing.assert_close(value, plain.state_dict()[name], rtol=0, atol=0)
    plain(input_ids=ids[0], labels=ids[0]).loss.backward()
    opt.step()
    with torch.no_grad():
        return plain(input_ids=ids[1], labels=ids[1]).loss.item()


@distributed(4)
def test_pipeline_checkpoint_resumes_at_other_sizes(
    build: Callable[[], nn.Module], tmp_path: Path
) -> None:
    @parameterize("layout", [{"tp_size": 2}, {"zero_stage": 1}])
    def case(layout: dict[str, Any]) -> None:
        torch.manual_seed(0)
        template = build()
        ids = batches(4)
        run = Run(template, pp_size=2, num_microbatches=2, **layout)
        for batch in ids[:2]:
            run.step(batch)
        root = tmp_path / "-".join(f"{k}{v}" for k, v in layout.items())
        run.save(root)
        files = list((root / "model").glob("*.safetensors"))
        index = json.loads((root / "model" / "model.safetensors.index.json").read_text())
        assert len(files) > 1 and "lm_head.weight" not in index["weight_map"]
        assert set(index["weight_map"]) == {
            n for n in template.state_dict() if n != "lm_head.weight"
        }
        before = run.loss(ids[3])  # the loss on ids[3] before the step that the runs compare
        run.step(ids[2])
        continued = run.loss(ids[3])
        # the step moves the compared loss by 10x the tolerance and more (measured: 1e-3)
        assert abs(continued - before) > 10 * TOL, (continued, before)

        flat = Run(template).load(root)  # pp 1 x tp 1 (dp 4)
        flat.step(ids[2])
        torch.testing.assert_close(flat.loss(ids[3]), continued, rtol=TOL, atol=TOL)
        deep = Run(template, pp_size=4, num_microbatches=4).load(root)
        deep.step(ids[2])
        torch.testing.assert_close(deep.loss(ids[3]), continued, rtol=TOL, atol=TOL)
        one_process = plain_continuation(template, root, ids[2:])
        torch.testing.assert_close(one_process, continued, rtol=TOL, atol=TOL)

    case()
