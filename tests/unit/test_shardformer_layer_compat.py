"""``kolossos.shardformer.layer`` and Colossal-AI's ``ShardConfig`` fields without a process
group: the names are kolossos' own objects, the norm converters keep the numbers of the module
they convert, the randomizer forks and restores random state, and every Colossal-AI option is
either honoured or refused by name."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import kolossos.nn.layer.parallel_1d as p1d
from kolossos.nn.layer.parallel_1d import is_sequence_parallel
from kolossos.nn.layer.parallel_1d._base import resolve_seq_parallel
from kolossos.nn.layer.parallel_1d.embedding import _embedding_options
from kolossos.shardformer import ShardConfig
from kolossos.shardformer import layer as sl
from kolossos.shardformer.layer.normalization import TorchRMSNorm
from kolossos.shardformer.layer.utils import Randomizer, create_randomizer_with_offset

# ------------------------------------------------------------------------------------ aliases


@pytest.mark.parametrize(
    ("name", "original"),
    [
        ("Linear1D_Col", p1d.Linear1D_Col),
        ("Linear1D_Row", p1d.Linear1D_Row),
        ("Embedding1D", p1d.Embedding1D),
        ("VocabParallelEmbedding1D", p1d.VocabParallelEmbedding1D),
        ("DropoutForParallelInput", p1d.DropoutForParallelInput),
        ("DropoutForReplicatedInput", p1d.DropoutForReplicatedInput),
        ("FusedLinear1D_Col", p1d.FusedLinear1D_Col),
        ("ParallelModule", p1d.ParallelModule1D),
    ],
)
def test_names_are_kolossos_own_classes(name: str, original: type) -> None:
    assert getattr(sl, name) is original


def test_module_paths_and_class_relations() -> None:
    from kolossos.shardformer.layer.dropout import DropoutForParallelInput
    from kolossos.shardformer.layer.linear import Linear1D_Col
    from kolossos.shardformer.layer.qkv_fused_linear import FusedLinear1D_Col

    assert Linear1D_Col is p1d.Linear1D_Col and FusedLinear1D_Col is p1d.FusedLinear1D_Col
    assert issubclass(DropoutForParallelInput, sl.ParallelModule)
    assert issubclass(DropoutForParallelInput, nn.Dropout)
    assert issubclass(sl.GPT2FusedLinearConv1D_Col, sl.FusedLinear1D_Col)
    assert issubclass(sl.GPT2FusedLinearConv1D_Row, sl.Linear1D_Row)
    assert set(sl.__all__) >= {"FusedLayerNorm", "FusedRMSNorm", "cross_entropy_1d"}


# ------------------------------------------------------------------------- keyword resolution


def test_seq_parallel_keywords_merge_with_kolossos_ones() -> None:
    assert resolve_seq_parallel("L", None, True, None, 1) == ("split_gather", 1)
    assert resolve_seq_parallel("L", None, False, None, 0) == (None, 0)
    assert resolve_seq_parallel("L", "split_gather", False, 0, 1) == ("split_gather", 0)
    assert resolve_seq_parallel("L", None, True, 2, 2) == ("split_gather", 2)
    with pytest.raises(ValueError, match="seq_dim=0 and seq_parallel_dim=2"):
        resolve_seq_parallel("L", None, True, 0, 2)
    assert resolve_seq_parallel("L", "ring", True, None, 1) == ("ring", 1)
    with pytest.raises(NotImplementedError, match="'all_to_all'"):
        resolve_seq_parallel("L", "all_to_all", True, None, 1)
    with pytest.raises(TypeError, match="seq_parallel='yes'"):
        resolve_seq_parallel("L", None, "yes", None, 1)  # type: ignore[arg-type]


def test_embedding_options_follow_f_embedding() -> None:
    assert _embedding_options("E", (None, 2.0, True), {}, freq_ok=True) is True
    assert _embedding_options("E", (), {"norm_type": 1.0}, freq_ok=False) is False
    with pytest.raises(NotImplementedError, match="max_norm"):
        _embedding_options("E", (1.0,), {}, freq_ok=True)
    with pytest.raises(NotImplementedError, match="sparse"):
        _embedding_options("E", (), {"sparse": True}, freq_ok=True)
    with pytest.raises(NotImplementedError, match="scale_grad_by_freq"):
        _embedding_options("E", (), {"scale_grad_by_freq": True}, freq_ok=False)
    with pytest.raises(TypeError, match="unexpected or repeated option norm_type"):
        _embedding_options("E", (None, 2.0), {"norm_type": 2.0}, freq_ok=True)
    with pytest.raises(TypeError, match="mode"):
        _embedding_options("E", (), {"mode": "sum"}, freq_ok=True)


# -------------------------------------------------------------------------------- ShardConfig


def test_shard_config_has_colossalai_fields() -> None:
    cfg = ShardConfig(enable_tensor_parallelism=False)
    for name in (
        "pipeline_stage_manager",
        "enable_fused_normalization",
        "enable_flash_attention",
        "enable_jit_fused",
        "enable_sequence_overlap",
        "inference_only",
        "inference_gptq",
    ):
        assert not getattr(cfg, name), name
    assert cfg.extra_kwargs == {} and cfg.tensor_parallel_size == cfg.tp_size == 1
    assert ShardConfig(extra_kwargs={}).extra_kwargs == {}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"inference_only": True},
        {"inference_gptq": True},
        {"pipeline_stage_manager": object()},
        {"extra_kwargs": {"quant": "gptq"}},
    ],
)
def test_shard_config_refuses_what_it_cannot_honour_by_name(kwargs: dict[str, Any]) -> None:
    name = next(iter(kwargs))
    with pytest.raises(NotImplementedError, match=name):
        ShardConfig(**kwargs)


def test_shard_config_type_checks_new_fields() -> None:
    with pytest.raises(TypeError, match="enable_jit_fused"):
        ShardConfig(enable_jit_fused=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="extra_kwargs"):
        ShardConfig(extra_kwargs=[("quant", "gptq")])  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        ShardConfig().enable_jit_fused = True  # type: ignore[misc]


# ------------------------------------------------------------------------------ normalization


def _grads(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.clone().requires_grad_()
    y = module(x)
    (y * torch.linspace(-1, 1, y.shape[-1])).sum().backward()
    grads = [x.grad, *(p.grad for p in module.parameters())]
    return (y.detach(), *(g.clone() for g in grads if g is not None))


def test_fused_layer_norm_keeps_the_torch_module_and_marks_it() -> None:
    norm = nn.LayerNorm(8)
    fused = sl.FusedLayerNorm.from_native_module(norm, process_group=None)
    assert fused is norm and not is_sequence_parallel(norm.weight)
    sl.FusedLayerNorm.from_native_module(norm, True)
    assert is_sequence_parallel(norm.weight) and is_sequence_parallel(norm.bias)
    assert sl.LayerNorm.from_native_module(norm) is norm
    with pytest.raises(TypeError, match=r"nn\.LayerNorm"):
        sl.FusedLayerNorm.from_native_module(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="unexpected arguments"):
        sl.FusedLayerNorm.from_native_module(norm, False, "extra")
    with pytest.raises(TypeError, match="unexpected arguments"):
        sl.LayerNorm.from_native_module(norm, eps=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rms_norm_has_the_numbers_of_llama_rms_norm(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    hf = LlamaRMSNorm(8, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.uniform_(0.5, 1.5)
    fused = sl.FusedRMSNorm.from_native_module(hf, sp_partial_derived=True)
    assert isinstance(fused, TorchRMSNorm) and fused.weight is hf.weight and fused.eps == 1e-5
    assert is_sequence_parallel(hf.weight)
    x = torch.randn(2, 3, 8).to(dtype)
    expected = _grads(hf, x)
    hf.weight.grad = None
    got = _grads(fused, x)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_rms_norm_converters_keep_torch_rms_norm_and_refuse_others() -> None:
    norm = nn.RMSNorm(8)
    assert sl.FusedRMSNorm.from_native_module(norm) is norm
    assert sl.RMSNorm.from_native_module(norm, True) is norm and is_sequence_parallel(norm.weight)
    with pytest.raises(TypeError, match="variance_epsilon"):
        sl.FusedRMSNorm.from_native_module(nn.LayerNorm(8))


@pytest.mark.parametrize("cls", ["FusedLayerNorm", "FusedRMSNorm", "LayerNorm", "RMSNorm"])
def test_norm_converters_are_not_instantiated(cls: str) -> None:
    with pytest.raises(NotImplementedError, match="from_native_module"):
        getattr(sl, cls)()
    assert issubclass(getattr(sl, cls), sl.BaseLayerNorm)
    with pytest.raises(TypeError):
        sl.BaseLayerNorm()  # type: ignore[abstract]


# --------------------------------------------------------------------------------- randomizer


def test_randomizer_forks_and_restores_random_state() -> None:
    torch.manual_seed(3)
    caller = torch.get_rng_state()
    randomizer = Randomizer(seed=42)
    with randomizer.fork_rng(enable_cpu=True):
        first = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), caller)  # the caller's stream is untouched
    with randomizer.fork_rng():  # on a CPU-only machine the CPU stream is the device stream
        second = torch.rand(4)
    reference = torch.Generator().manual_seed(42)
    expected = torch.rand(8, generator=reference)
    torch.testing.assert_close(torch.cat([first, second]), expected, rtol=0, atol=0)
    assert torch.equal(randomizer.device_rng_state, randomizer.cuda_rng_state)


def test_randomizer_index_and_offsets_without_distributed() -> None:
    Randomizer.reset_index()
    assert Randomizer.index() == 0 and Randomizer.is_randomizer_index_synchronized()
    Randomizer.increment_index()
    assert Randomizer.index() == 1
    Randomizer.synchronize_index()  # nothing to agree with
    first = create_randomizer_with_offset(10)
    assert first.seed == 11 and Randomizer.index() == 2
    assert create_randomizer_with_offset(10, offset_by_index=False).seed == 10
    assert Randomizer.index() == 2
    Randomizer.reset_index()
    assert Randomizer.index() == 0
