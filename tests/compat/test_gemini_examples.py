"""The Gemini examples of the documents as tests, and the signatures and import paths they use.

* Meet Gemini (CHECKLIST §20 scenario 5, F0:1397-1417): ResNet-18 built under
  ``ColoInitContext``, ``HybridAdam``, ``GeminiPlugin(placement_policy='cuda',
  strict_ddp_mode=True, max_norm=1.0, initial_scale=2**5)``, one process as its doc-test runs it.
* ZeRO with chunks (F0:9378-9400, 9153-9164): ``GeminiDDP(model, device=get_current_device(),
  placement_policy=..., pin_memory=True, search_range_mb=32)`` from ``kolossos.nn.parallel``,
  ``GeminiAdamOptimizer(model, lr=1e-3, initial_scale=2**5)``, ``optimizer.backward(loss)``.
* ``zero_model_wrapper`` / ``zero_optim_wrapper`` for stages 1/2 (the stage-3 path is the NVMe
  tutorial, ``tests/e2e/test_nvme_gemini.py``).

Code marked ``# doc`` is the documents' with the import rewritten (``colossalai`` ->
``kolossos``, torchvision's ResNet-18 -> ``kolossos.models``) and CUDA devices replaced by
``get_current_device()``; what follows it checks what the documents promise.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest
import torch

import kolossos
from kolossos.testing import spawn

GEMINI_PLUGIN = (
    "chunk_config_dict=None chunk_init_device=None placement_policy='static' shard_param_frac=1.0 "
    "offload_optim_frac=0.0 offload_param_frac=0.0 warmup_non_model_data_ratio=0.8 "
    "steady_cuda_cap_ratio=0.9 precision='fp16' pin_memory=False force_outputs_fp32=False "
    "strict_ddp_mode=False search_range_m=32 hidden_dim=None min_chunk_size_m=32 memstats=None "
    "gpu_margin_mem_ratio=0.0 initial_scale=65536 min_scale=1 growth_factor=2 backoff_factor=0.5 "
    "growth_interval=1000 hysteresis=2 max_scale=4294967296 max_norm=0.0 norm_type=2.0 "
    "verbose=False *device=None *device_memory_budget=None *colo_process_group=None"
)


def describe(fn: Any) -> list[str]:
    """Parameters as ``name`` / ``name=<default repr>`` / ``*name`` (keyword-only)."""
    out = []
    for name, p in inspect.signature(fn).parameters.items():
        if name == "self":
            continue
        text = name if p.default is p.empty else f"{name}={p.default!r}"
        out.append(f"*{text}" if p.kind is p.KEYWORD_ONLY else text)
    return out


def P(spec: str) -> list[str]:
    """A pin written as one space-separated string."""
    return spec.split()


def test_signatures() -> None:
    from kolossos.booster.plugin import GeminiPlugin
    from kolossos.zero import ColoInitContext, zero_model_wrapper, zero_optim_wrapper

    # Colossal-AI 0.3.3+'s order (the list); 0.3.1's ``device`` is keyword-only at the
    # end, with kolossos' device_memory_budget.
    assert describe(GeminiPlugin.__init__) == P(GEMINI_PLUGIN)
    assert describe(zero_model_wrapper) == P("model zero_stage=1 gemini_config=None verbose=False")
    assert describe(zero_optim_wrapper) == P(
        "model optimizer initial_scale=65536 growth_factor=2 backoff_factor=0.5 "
        "growth_interval=1000 hysteresis=2 min_scale=1 max_scale=4294967296 max_norm=0.0 "
        "norm_type=2.0 optim_config=None verbose=False"
    )
    assert describe(ColoInitContext.__init__) == [
        "device=None",
        "dtype=torch.float32",
        "default_pg=None",
        "default_dist_spec=None",
    ]


@pytest.mark.parametrize(
    ("module", "names"),
    [
        ("kolossos.booster.plugin", ["GeminiPlugin"]),
        (
            "kolossos.zero",
            P(
                "ColoInitContext GeminiAdamOptimizer GeminiDDP LowLevelZeroOptimizer ZeroDDP "
                "ZeroOptimizer post_process_colo_init_ctx zero_model_wrapper zero_optim_wrapper"
            ),
        ),
        ("kolossos.nn.parallel", ["GeminiDDP", "GeminiAdamOptimizer"]),
        ("kolossos.utils.model.colo_init_context", ["ColoInitContext"]),
    ],
)
def test_documented_import_paths(module: str, names: list[str]) -> None:
    imported = importlib.import_module(module)
    for name in names:
        assert hasattr(imported, name), f"{module}.{name}"
    from kolossos.booster.plugin import PLUGINS, GeminiPlugin

    assert PLUGINS["gemini"] is GeminiPlugin


def _meet_gemini(rank: int, world_size: int, port: int) -> dict[str, Any]:
    kolossos.launch(config={}, rank=rank, world_size=world_size, host="localhost", port=port)
    from kolossos.booster import Booster  # doc
    from kolossos.booster.plugin import GeminiPlugin  # doc
    from kolossos.models import resnet18  # doc: from torchvision.models import resnet18
    from kolossos.nn.optimizer import HybridAdam
    from kolossos.zero import ColoInitContext  # doc

    plugin = GeminiPlugin(
        placement_policy="cuda", strict_ddp_mode=True, max_norm=1.0, initial_scale=2**5
    )  # doc
    booster = Booster(plugin=plugin)  # doc
    ctx = ColoInitContext()  # doc
    with ctx:  # doc
        model = resnet18()  # doc
    optimizer = HybridAdam(model.parameters(), lr=1e-3)  # doc
    criterion = lambda x: x.mean()  # noqa: E731  (doc)
    model, optimizer, criterion, _, _ = booster.boost(model, optimizer, criterion)  # doc

    # One training step, as the booster tutorial trains.
    before = {n: t.clone() for n, t in model.named_full_tensors()}
    x = torch.randn(2, 3, 32, 32)
    loss = criterion(model(x))
    booster.backward(loss, optimizer)
    optimizer.step()
    optimizer.zero_grad()
    after = dict(model.named_full_tensors())
    changed = sum(not torch.equal(before[n], after[n]) for n in after if n.endswith("weight"))
    return {
        "loss": loss.item(),
        "changed": changed,
        "weights": sum(n.endswith("weight") for n in after),
        "scale": optimizer.loss_scale,
    }


def test_meet_gemini_quick_start() -> None:
    """Scenario 5 on one process: boosts, and a step with fp16 weights moves every weight."""
    result = spawn(_meet_gemini, 1)[0]
    assert torch.isfinite(torch.tensor(result["loss"]))
    assert result["changed"] == result["weights"] > 20
    assert result["scale"] == 2**5


class GPTLMModel(torch.nn.Module):  # the documents' model (F0:9175-9200)
    def __init__(
        self,
        hidden_size: int = 768,
        num_layers: int = 12,
        num_attention_heads: int = 12,
        max_seq_len: int = 1024,
        vocab_size: int = 50257,
        checkpoint: bool = False,
    ) -> None:
        from transformers import GPT2Config, GPT2LMHeadModel

        super().__init__()
        self.checkpoint = checkpoint
        self.model = GPT2LMHeadModel(
            GPT2Config(n_embd=hidden_size, n_layer=num_layers, n_head=num_attention_heads,
                       n_positions=max_seq_len, n_ctx=max_seq_len, vocab_size=vocab_size,
                       bos_token_id=0, eos_token_id=0)  # ids: not in the doc (silence warnings)
        )  # fmt: skip
        if checkpoint:
            self.model.gradient_checkpointing_enable()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=not self.checkpoint
        )[0]


class GPTLMLoss(torch.nn.Module):  # the documents' loss
    def __init__(self) -> None:
        super().__init__()
        self.loss_fn = torch.nn.CrossEntropyLoss()

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        return self.loss_fn(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))


def _zero_with_chunks(rank: int, world_size: int, port: int) -> list[float]:
    kolossos.launch(config={}, rank=rank, world_size=world_size, host="localhost", port=port)
    from kolossos.nn.parallel import GeminiAdamOptimizer, GeminiDDP  # doc
    from kolossos.utils import get_current_device  # doc

    def gemini_zero_dpp(model: torch.nn.Module, placement_policy: str = "auto") -> GeminiDDP:
        model = GeminiDDP(
            model,
            device=get_current_device(),
            placement_policy=placement_policy,
            pin_memory=True,
            search_range_mb=32,
        )  # doc
        return model  # doc

    torch.manual_seed(0)
    # doc: gpt2_medium(checkpoint=True); tiny here, activation checkpointing kept
    model = GPTLMModel(64, 2, 2, max_seq_len=32, vocab_size=128, checkpoint=True)
    model = gemini_zero_dpp(model)  # doc: (model, pg, args.placement)
    optimizer = GeminiAdamOptimizer(model, lr=1e-3, initial_scale=2**5)  # doc
    criterion = GPTLMLoss()  # doc
    gen = torch.Generator().manual_seed(rank)
    data = [torch.randint(0, 128, (2, 32), generator=gen) for _ in range(2)]
    losses = []
    for step in range(6):
        input_ids = data[step % 2]
        attn_mask = torch.ones_like(input_ids)
        optimizer.zero_grad()  # doc
        outputs = model(input_ids, attn_mask)  # doc
        loss = criterion(outputs.float(), input_ids)  # doc: criterion(outputs, input_ids)
        optimizer.backward(loss)  # doc
        optimizer.step()  # doc
        losses.append(loss.item())
    return losses


def test_zero_with_chunks_gpt2_trains() -> None:
    """The GPT-2 example's Gemini part (fp16, auto placement) on 2 ranks: losses fall from
    ln(128) on data the model can learn (each rank repeats its own batches)."""
    pytest.importorskip("transformers")
    losses = spawn(_zero_with_chunks, 2)
    for rank_losses in losses:
        assert all(torch.isfinite(torch.tensor(rank_losses)))
        assert 4.0 < rank_losses[0] < 5.5  # ln(128) = 4.85
        assert rank_losses[-1] < rank_losses[0] - 0.05


def _wrappers_low_level(rank: int, world_size: int, port: int, stage: int) -> str:
    kolossos.launch(config={}, rank=rank, world_size=world_size, host="localhost", port=port)
    from kolossos.zero import zero_model_wrapper, zero_optim_wrapper

    model = torch.nn.Linear(8, 4)
    wrapped = zero_model_wrapper(model, zero_stage=stage)
    assert wrapped is model
    optimizer = zero_optim_wrapper(model, torch.optim.Adam(model.parameters()), max_norm=1.0)
    optimizer.backward(model(torch.randn(2, 8)).sum())
    optimizer.step()
    with pytest.raises(ValueError, match="gemini_config is used by zero_stage=3 only"):
        zero_model_wrapper(torch.nn.Linear(2, 2), zero_stage=stage, gemini_config={"x": 1})
    with pytest.raises(ValueError, match="needs the model returned by zero_model_wrapper"):
        zero_optim_wrapper(torch.nn.Linear(2, 2), torch.optim.Adam(model.parameters()))
    return f"{type(optimizer).__name__}:{optimizer.options.partition_grad}"


def test_zero_wrappers_stage_1_and_2() -> None:
    assert spawn(_wrappers_low_level, 2, stage=1)[0] == "LowLevelZeroOptimizer:False"
    assert spawn(_wrappers_low_level, 2, stage=2)[0] == "LowLevelZeroOptimizer:True"


def test_colo_init_context_places_and_types_what_is_built_inside() -> None:
    from kolossos.utils.model.colo_init_context import ColoInitContext, post_process_colo_init_ctx

    with ColoInitContext(device="meta", dtype=torch.float64):
        inside = torch.nn.Linear(4, 4)
    outside = torch.nn.Linear(4, 4)
    assert inside.weight.device.type == "meta" and inside.weight.dtype == torch.float64
    assert outside.weight.device.type == "cpu" and outside.weight.dtype == torch.float32
    with ColoInitContext():  # the current accelerator device (the CPU here), fp32
        default = torch.nn.Linear(4, 4)
    assert default.weight.device.type == "cpu" and default.weight.dtype == torch.float32
    moved = post_process_colo_init_ctx(torch.nn.Linear(2, 2), "cpu", torch.float64)
    assert moved.weight.dtype == torch.float64
    with pytest.raises(TypeError, match="default_pg"):
        ColoInitContext(default_pg=object())
    with pytest.raises(TypeError, match=r"must be a floating torch\.dtype"):
        ColoInitContext(dtype=torch.int64)
