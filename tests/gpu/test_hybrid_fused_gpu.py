"""ShardFormer's fused kernels on a GPU: ``HybridParallelPlugin(tp_size=1,
enable_all_optimization=True)`` against the same plugin without them, losses every step and
parameters at the end.

On CUDA ``enable_jit_fused`` runs the dropout + residual add as a ``torch.compile``'d kernel and
GPT-2's Python tanh-GELU as torch's fused one, and at tp 1 the LM head's products run over a
vocabulary padded to a multiple of 64 (``AlignedLMHead``); this checks that all are taken (no
fallback) and give the unfused numbers. One process with a single-rank NCCL group; TF32 off so
that fp32 is compared tightly.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn as nn

from kolossos.testing import assert_moved, snapshot

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# VOCAB is no multiple of 64: the LM head's products run padded to 512 rows (AlignedLMHead)
STEPS, BATCH, SEQ, VOCAB = 10, 4, 64, 500
# Adam with eps=1e-3 (as tests/gpu/test_gemini_cuda_parity.py): a gradient far below eps, such as
# the key biases' zero one plus rounding, gives a step far below lr instead of an lr-sized one
LR, EPS = 5e-2, 1e-3
EACH = {"fp32": None, "bf16": 2.0}
# fp32: the fused kernels change only rounding (tanh-GELU, SDPA's kernel); bf16: both runs round
# the same products but kernels may differ per shape
TOL = {"fp32": (1e-4, 1e-4), "bf16": (2e-2, 3e-2)}


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=128, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def train(model: nn.Module, precision: str, **options: Any) -> tuple[list[float], nn.Module]:
    from kolossos.booster import Booster
    from kolossos.booster.plugin import HybridParallelPlugin

    plugin = HybridParallelPlugin(tp_size=1, pp_size=1, precision=precision, **options)
    booster = Booster(plugin=plugin)
    model = copy.deepcopy(model).cuda()
    boosted, opt, *_ = booster.boost(model, torch.optim.Adam(model.parameters(), lr=LR, eps=EPS))
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    ids = ids.cuda()
    losses = []
    for _ in range(STEPS):
        loss = boosted(input_ids=ids, labels=ids).loss
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, boosted.unwrap()


def _error(model: nn.Module, reference: dict[str, torch.Tensor]) -> float:
    """Largest element difference of ``model``'s parameters from ``reference``'s."""
    return max(
        float((p.detach().float() - reference[n].detach().float()).abs().max())
        for n, p in model.named_parameters()
    )


@pytest.mark.usefixtures("nccl_group")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_fused_kernels_on_cuda_match_unfused(precision: str) -> None:
    """fp32: the fused run equals the unfused one up to rounding. bf16: Python's tanh-GELU rounds
    each of its eight steps to bf16 and the fused kernel only its result, so the two bf16 runs
    differ by more than bf16 rounding; both are compared with the fp32 run, and the fused one
    must be as close to it as the unfused one."""
    from kolossos.shardformer.layer.fused import fused_kernel_name

    model = gpt2()
    initial = snapshot(model)
    ref_losses, ref = train(model, "fp32")
    plain_losses, plain = train(model, precision) if precision != "fp32" else (ref_losses, ref)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, fused = train(model, precision, enable_all_optimization=True)
    fallbacks = [str(w.message) for w in caught if "torch.compile failed" in str(w.message)]
    assert not fallbacks, fallbacks
    assert fused_kernel_name(torch.device("cuda")) == "compile"
    from kolossos.shardformer.layer.aligned_head import AlignedLMHead

    assert type(fused.lm_head) is AlignedLMHead and fused.lm_head.weight is fused.get_parameter(
        "transformer.wte.weight"
    )
    acts = [m for m in fused.modules() if isinstance(m, nn.GELU)]
    assert len(acts) == 2 and all(a.approximate == "tanh" for a in acts)
    rtol, atol = TOL[precision]
    expected = dict(ref.named_parameters())
    if precision == "fp32":
        torch.testing.assert_close(losses, ref_losses, rtol=rtol, atol=atol)
        for name, value in fused.named_parameters():
            torch.testing.assert_close(value, expected[name], rtol=rtol, atol=atol, msg=name)
    else:
        torch.testing.assert_close(losses[:2], ref_losses[:2], rtol=rtol, atol=atol)
        loss_error = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
        plain_loss_error = max(abs(a - b) for a, b in zip(plain_losses, ref_losses, strict=True))
        assert loss_error <= 1.5 * plain_loss_error + atol
        assert _error(fused, expected) <= 1.5 * _error(plain, expected) + atol
    trained = {n: p.float().cpu() for n, p in fused.named_parameters()}
    assert_moved(initial, trained, atol, each=EACH[precision])
