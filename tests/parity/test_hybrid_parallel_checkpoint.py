"""HybridParallelPlugin checkpoints are full Hugging Face / name-keyed files that resume anywhere.

Train GPT-2 and LLaMA at tp 2 x dp 2 (4 ranks), save model and optimizer, then continue three
ways from the files: the same run, a fresh tp 4 run, and one plain process (no plugin). The next
training step and the loss after it must agree. ``transformers``' ``from_pretrained`` loads the
saved directory, and a ``save_pretrained`` directory loads into the sharded model.
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
from kolossos.interface import unwrap_model
from kolossos.nn.layer.parallel_1d import gather_tp_full, get_tp_spec
from kolossos.testing import distributed, parameterize
from kolossos.testing.parity import global_mean, shard

SEQ, BATCH = 16, 4
# fp32 everywhere: the three continuations differ only in the order of sums (TP all-reduces, ZeRO
# partitions), so losses agree to float32 rounding.
TOL = 1e-5


@pytest.fixture(scope="module")
def build() -> Callable[[str], nn.Module]:
    transformers = pytest.importorskip("transformers")
    families: dict[str, Any] = {
        "gpt2": lambda: transformers.GPT2LMHeadModel(
            transformers.GPT2Config(
                vocab_size=100, n_positions=SEQ, n_embd=32, n_layer=2, n_head=4,
                attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0,
            )
        ),
        # 4 KV heads: the model must also shard at tp 4
        "llama": lambda: transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ,
                bos_token_id=0, eos_token_id=0, pad_token_id=0,
            )
        ),
    }  # fmt: skip
    return lambda family: families[family]()


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1, eps=1e-6)


def batches(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(2, 100, (BATCH, SEQ), generator=gen) for _ in range(n)]


def step_then_loss(
    model: nn.Module, step: Callable[[torch.Tensor], None], ids: list[torch.Tensor], dp: int
) -> float:
    """One training step on ``ids[0]``, then the (global mean) loss on ``ids[1]``."""
    dp_rank = dist.get_rank() // (dist.get_world_size() // dp)
    step(shard(ids[0], dp_rank, dp))
    with torch.no_grad():
        ids1 = shard(ids[1], dp_rank, dp)
        return global_mean(model(input_ids=ids1, labels=ids1).loss)


def boosted_run(model: nn.Module, tp: int, zero_stage: int) -> tuple[Booster, nn.Module, Any]:
    plugin = HybridParallelPlugin(tp_size=tp, precision="fp32", zero_stage=zero_stage)
    booster = Booster(plugin=plugin)
    boosted, opt, _, _, _ = booster.boost(model, adamw(model))
    return booster, boosted, opt


def booster_step(booster: Booster, model: nn.Module, opt: Any) -> Callable[[torch.Tensor], None]:
    def step(ids: torch.Tensor) -> None:
        booster.backward(model(input_ids=ids, labels=ids).loss, opt)
        opt.step()
        opt.zero_grad()

    return step


def full_state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: gather_tp_full(p.detach(), s) if (s := get_tp_spec(p)) is not None else p.detach()
        for n, p in module.named_parameters()
    }


@distributed(4)
def test_save_at_tp2_dp2_resume_at_tp4_in_one_process_and_in_transformers(
    build: Callable[[str], nn.Module], tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers")

    @parameterize("family", ["gpt2", "llama"])
    @parameterize("zero_stage", [0, 1])
    def case(family: str, zero_stage: int) -> None:
        torch.manual_seed(0)
        template = build(family)
        ids = batches(4)
        booster, model, opt = boosted_run(copy.deepcopy(template), 2, zero_stage)
        train = booster_step(booster, model, opt)
        for batch in ids[:2]:
            train(shard(batch, dist.get_rank() // 2, 2))
        root = tmp_path / f"{family}-{zero_stage}"
        # tiny shards: the model spans several files, streamed one by one
        booster.save_model(model, str(root / "model"), shard=True, size_per_shard=0.01,
                           use_safetensors=True)  # fmt: skip
        booster.save_optimizer(opt, str(root / "optim"), shard=True, size_per_shard=0.01)
        assert len(list((root / "model").glob("*.safetensors"))) > 1
        with torch.no_grad():  # the loss on ids[3] before the step that the runs compare
            ids3 = shard(ids[3], dist.get_rank() // 2, 2)
            before = global_mean(model(input_ids=ids3, labels=ids3).loss)
        continued = step_then_loss(model, train, ids[2:], dp=2)
        # the step moves the compared loss by 10x the tolerance and more (measured: 1e-3)
        assert abs(continued - before) > 10 * TOL, (continued, before)

        booster4, model4, opt4 = boosted_run(copy.deepcopy(template), 4, zero_stage)
        booster4.load_model(model4, str(root / "model"))
        booster4.load_optimizer(opt4, str(root / "optim"))
        at_tp4 = step_then_loss(model4, booster_step(booster4, model4, opt4), ids[2:], dp=1)

        plain = copy.deepcopy(template)
        plain_opt = adamw(plain)
        register_param_names(plain_opt, plain)
        io = GeneralCheckpointIO()
        io.load_model(plain, str(root / "model"))
        io.load_optimizer(plain_opt, str(root / "optim"))
        hf = type(template).from_pretrained(str(root / "model"))
        for name, value in hf.state_dict().items():
            torch.testing.assert_close(value, plain.state_dict()[name], rtol=0, atol=0)

        def plain_step(batch: torch.Tensor) -> None:
            plain(input_ids=batch, labels=batch).loss.backward()
            plain_opt.step()
            plain_opt.zero_grad()

        one_process = step_then_loss(plain, plain_step, ids[2:], dp=1)
        torch.testing.assert_close(at_tp4, continued, rtol=TOL, atol=TOL)
        torch.testing.assert_close(one_process, continued, rtol=TOL, atol=TOL)
        assert isinstance(hf, transformers.PreTrainedModel)

    case()

    @parameterize("family", ["gpt2", "llama"])
    def from_transformers(family: str) -> None:
        """A ``save_pretrained`` directory loads into the sharded model (cut per rank)."""
        torch.manual_seed(0)
        source = build(family)
        path = tmp_path / f"hf-{family}"
        if dist.get_rank() == 0:
            source.save_pretrained(str(path))
        dist.barrier()
        torch.manual_seed(1)  # different initial weights
        booster, model, _ = boosted_run(build(family), 2, 1)
        booster.load_model(model, str(path))
        loaded = full_state(unwrap_model(model))
        for name, value in source.named_parameters():
            torch.testing.assert_close(loaded[name], value.detach(), rtol=0, atol=0)

    from_transformers()

    @parameterize("zero_stage", [0, 1])
    def bf16_masters_survive(zero_stage: int) -> None:
        """The file holds the fp32 masters, and loading restores them exactly (not the bf16
        working weights' rounding)."""
        torch.manual_seed(0)
        template = build("llama")

        def run() -> tuple[Booster, nn.Module, Any]:
            plugin = HybridParallelPlugin(tp_size=2, precision="bf16", zero_stage=zero_stage)
            booster = Booster(plugin=plugin)
            model = copy.deepcopy(template)
            boosted, opt, _, _, _ = booster.boost(model, adamw(model))
            return booster, boosted, opt

        booster, model, opt = run()
        booster_step(booster, model, opt)(shard(batches(1)[0], dist.get_rank() // 2, 2))
        path = str(tmp_path / f"bf16-{zero_stage}")
        booster.save_model(model, path, shard=True)
        booster2, model2, opt2 = run()
        booster2.load_model(model2, path)
        for p, p2 in zip(opt.working_params(), opt2.working_params(), strict=True):
            assert torch.equal(opt.full_param(p, dst=None), opt2.full_param(p2, dst=None))
            assert torch.equal(p, p2) and p2.dtype == torch.bfloat16

    bf16_masters_survive()
