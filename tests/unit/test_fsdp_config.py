"""TorchFSDPPlugin's argument mapping (FSDP1 vocabulary -> FSDP2 recipe), its rejections, and
which submodules become FSDP units. Pure logic: no process group."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import (
    BackwardPrefetch,
    CPUOffload,
    CPUOffloadPolicy,
    MixedPrecision,
    MixedPrecisionPolicy,
    ShardingStrategy,
)
from torch.distributed.fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

from kolossos.booster.plugin.plugin_base import config_from_arguments
from kolossos.fsdp import TorchFSDPConfig, build_config
from kolossos.fsdp.wrap import plan_units, transformer_block_classes
from kolossos.testing.parity import TinyMLP


# --- sharding strategy ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "sharding", "reshard", "hybrid"),
    [
        (None, "FULL_SHARD", True, False),
        (ShardingStrategy.FULL_SHARD, "FULL_SHARD", True, False),
        (ShardingStrategy.SHARD_GRAD_OP, "SHARD_GRAD_OP", False, False),
        ("shard_grad_op", "SHARD_GRAD_OP", False, False),
        (ShardingStrategy.NO_SHARD, "NO_SHARD", False, True),
        (ShardingStrategy.HYBRID_SHARD, "HYBRID_SHARD", True, True),
        (ShardingStrategy._HYBRID_SHARD_ZERO2, "_HYBRID_SHARD_ZERO2", False, True),
    ],
)
def test_sharding_strategy_maps_to_reshard_and_mesh(
    value: Any, sharding: str, reshard: bool, hybrid: bool
) -> None:
    cfg = build_config(sharding_strategy=value)
    assert (cfg.sharding, cfg.reshard_after_forward, cfg.hybrid) == (sharding, reshard, hybrid)


def test_unknown_sharding_strategy_is_rejected() -> None:
    with pytest.raises(ValueError, match="sharding_strategy='ZERO4'"):
        build_config(sharding_strategy="ZERO4")


def test_hybrid_needs_a_pair_of_groups_or_a_mesh() -> None:
    group = torch.distributed.ProcessGroup(torch.distributed.HashStore(), 0, 1)  # never used
    with pytest.raises(ValueError, match="shard_group, replicate_group"):
        build_config(process_group=group, sharding_strategy="HYBRID_SHARD")
    with pytest.raises(ValueError, match="needs sharding_strategy=HYBRID_SHARD"):
        build_config(process_group=(group, group))
    with pytest.raises(TypeError, match="ProcessGroup"):
        build_config(process_group="world")
    with pytest.raises(ValueError, match="not both"):
        build_config(process_group=group, device_mesh=object())


# --- offload, prefetch ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, False),
        (False, False),
        (True, True),
        (CPUOffload(offload_params=False), False),
        (CPUOffload(offload_params=True), True),
        (CPUOffloadPolicy(pin_memory=False), True),
    ],
)
def test_cpu_offload(value: Any, expected: bool) -> None:
    assert build_config(cpu_offload=value).offload_params is expected


def test_cpu_offload_rejects_other_types() -> None:
    with pytest.raises(TypeError, match="cpu_offload='yes'"):
        build_config(cpu_offload="yes")


def test_backward_prefetch() -> None:
    assert build_config(backward_prefetch=None).backward_prefetch
    assert build_config(backward_prefetch=BackwardPrefetch.BACKWARD_PRE).backward_prefetch
    with pytest.raises(NotImplementedError, match="BACKWARD_POST"):
        build_config(backward_prefetch=BackwardPrefetch.BACKWARD_POST)
    with pytest.raises(ValueError, match="backward_prefetch"):
        build_config(backward_prefetch=3)


# --- precision ------------------------------------------------------------------------------
def test_precision_argument() -> None:
    assert build_config().param_dtype is None
    cfg = build_config(precision="bf16")
    assert (cfg.param_dtype, cfg.reduce_dtype, cfg.output_dtype) == (
        torch.bfloat16,
        torch.float32,
        torch.float32,
    )
    assert not cfg.loss_scaled
    assert build_config(precision="fp16").loss_scaled
    with pytest.raises(ValueError, match="precision='fp8'"):
        build_config(precision="fp8")


def test_fsdp1_mixed_precision_maps_onto_the_policy() -> None:
    mp = MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)
    cfg = build_config(mixed_precision=mp)
    assert cfg.precision == "bf16"
    assert (cfg.param_dtype, cfg.reduce_dtype, cfg.buffer_dtype) == (
        torch.bfloat16,
        None,  # FSDP1 and FSDP2 both reduce in param_dtype then
        torch.bfloat16,
    )
    assert cfg.cast_forward_inputs  # FSDP1's cast_root_forward_inputs=True
    assert cfg.fp32_module_classes == (nn.modules.batchnorm._BatchNorm,)
    assert build_config(mixed_precision=MixedPrecision()).fp32_module_classes == ()


def test_fsdp2_policy_and_precision_strings() -> None:
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    cfg = build_config(mixed_precision=policy)
    assert (cfg.precision, cfg.reduce_dtype, cfg.loss_scaled) == ("fp16", torch.float32, True)
    assert build_config(mixed_precision="bf16").param_dtype == torch.bfloat16


def test_precision_conflicts_and_unsupported_fields_are_rejected() -> None:
    with pytest.raises(ValueError, match="disagrees"):
        build_config(precision="fp16", mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    with pytest.raises(NotImplementedError, match="keep_low_precision_grads"):
        build_config(mixed_precision=MixedPrecision(keep_low_precision_grads=True))
    with pytest.raises(TypeError, match="mixed_precision"):
        build_config(mixed_precision=torch.bfloat16)


# --- other arguments ------------------------------------------------------------------------
def test_fsdp1_extra_arguments() -> None:
    cfg = build_config(forward_prefetch=True, limit_all_gathers=False)
    assert cfg.forward_prefetch
    build_config(use_orig_params=True, device_id="cpu")
    with pytest.raises(NotImplementedError, match="use_orig_params=False"):
        build_config(use_orig_params=False)
    with pytest.raises(TypeError, match=r"unexpected keyword argument.*bucket_cap_mb"):
        build_config(bucket_cap_mb=25)
    with pytest.raises(ValueError, match="device_id=3"):
        build_config(device_id=3)  # a CUDA index on this CPU process


def test_ignored_modules_and_states() -> None:
    model = TinyMLP()
    cfg = build_config(ignored_states=[model.fc1, model.fc2.bias])
    assert cfg.ignored_modules == (model.fc1,) and cfg.ignored_params == (model.fc2.bias,)
    with pytest.raises(ValueError, match="not both"):
        build_config(ignored_modules=[model.fc1], ignored_states=[model.fc2])


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="checkpoint_format='zip'"):
        build_config(checkpoint_format="zip")
    with pytest.raises(TypeError, match="sync_module_states"):
        build_config(sync_module_states="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="growth_interval=0"):
        config_from_arguments(build_config, {"growth_interval": 0})  # as the plugin groups it
    with pytest.raises(ValueError, match="param_dtype"):
        TorchFSDPConfig(precision="bf16")  # the dtype must come with it
    with pytest.raises(TypeError, match="param_init_fn"):
        build_config(param_init_fn=42)  # type: ignore[arg-type]


def test_plugin_rejects_bad_arguments_before_needing_a_process_group() -> None:
    from kolossos.booster.plugin import PLUGINS, TorchFSDPPlugin

    assert PLUGINS["torch_fsdp"] is TorchFSDPPlugin
    with pytest.raises(NotImplementedError, match="BACKWARD_POST"):
        TorchFSDPPlugin(backward_prefetch=BackwardPrefetch.BACKWARD_POST)
    with pytest.raises(RuntimeError, match=r"torch\.distributed to be initialised"):
        TorchFSDPPlugin()


# --- wrapping -----------------------------------------------------------------------------
class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def _names(model: nn.Module, policy: Any, **kwargs: Any) -> list[str]:
    return [u.name for u in plan_units(model, policy, **kwargs)]


def test_default_wraps_top_level_children_with_parameters() -> None:
    assert _names(TinyMLP(), None) == ["fc1", "fc2"]  # not the parameter-free activation
    assert _names(_Tied(), None) == ["body"]  # tied modules stay in the root's unit


def test_default_wraps_each_transformer_block() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=3, n_embd=16, n_head=2, vocab_size=32, n_positions=8)
    model = nn.Sequential(transformers.GPT2LMHeadModel(config))  # found even when nested
    assert {c.__name__ for c in transformer_block_classes(model)} == {"GPT2Block"}
    assert _names(model, None) == [f"0.transformer.h.{i}" for i in range(3)]


def test_fsdp1_policies() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 64), nn.Linear(64, 8)))
    assert _names(model, ModuleWrapPolicy({nn.Linear})) == ["0", "1.0", "1.1"]
    assert _names(model, {nn.Sequential}) == ["1"]
    sized = functools.partial(size_based_auto_wrap_policy, min_num_params=500)
    assert _names(model, sized) == ["1.0", "1.1"]  # 520 each; "1" has nothing left over
    by_class = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={nn.Linear})
    assert _names(model, by_class) == ["0", "1.0", "1.1"]
    assert _names(model, CustomPolicy(lambda m: m is model[1])) == ["1"]


def test_policy_rejections() -> None:
    model = _Tied()
    with pytest.raises(ValueError, match=r"'head'.*shared"):
        plan_units(model, {nn.Linear})
    with pytest.raises(NotImplementedError, match="per-module FSDP arguments"):
        plan_units(
            model, CustomPolicy(lambda m: {"sharding_strategy": 1} if m is model.body else False)
        )
    with pytest.raises(TypeError, match="auto_wrap_policy"):
        plan_units(model, 42)
    with pytest.raises(TypeError, match="Module classes"):
        plan_units(model, {int})


def test_ignored_and_fp32_modules() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    units = plan_units(model, None, ignored_modules=[model[0]], fp32_classes=(nn.BatchNorm1d,))
    assert [(u.name, u.fp32) for u in units] == [("1", True), ("2", False)]
