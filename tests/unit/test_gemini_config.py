"""GeminiConfig: every GeminiPlugin / zero_model_wrapper argument is honoured or refused by name."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch

from kolossos.amp import LOSS_SCALE_KEYWORDS
from kolossos.booster.plugin.plugin_base import config_from_arguments
from kolossos.zero.gemini.gemini_config import GeminiConfig


def _config(**kwargs: Any) -> GeminiConfig:
    """The config GeminiPlugin builds from these keywords (loss-scale ones grouped)."""
    return config_from_arguments(GeminiConfig, kwargs)


def test_defaults_are_colossal_ai_s() -> None:
    config = GeminiConfig()
    assert config.placement_policy == "static"
    assert (config.shard_param_frac, config.offload_optim_frac, config.offload_param_frac) == (
        1.0,
        0.0,
        0.0,
    )
    assert config.precision == "fp16" and config.dtype == torch.float16
    assert config.loss_scale.initial_scale == 2**16 and config.loss_scale.max_scale == 2**32
    assert (config.search_range_m, config.min_chunk_size_m, config.hidden_dim) == (32, 32, None)


def test_kwargs_split_between_ddp_and_optimizer() -> None:
    config = _config(
        placement_policy="auto",
        gpu_margin_mem_ratio=0.5,
        precision="bf16",
        max_norm=1,
        initial_scale=2**5,
        device_memory_budget=2**20,
        pin_memory=True,
    )
    ddp, opt = config.ddp_kwargs(), config.optimizer_kwargs()
    assert ddp["mixed_precision"] == torch.bfloat16 and ddp["placement_policy"] == "auto"
    assert ddp["device_memory_budget"] == 2**20 and ddp["pin_memory"] is True
    assert "precision" not in ddp and "device" not in ddp and "initial_scale" not in ddp
    assert opt["gpu_margin_mem_ratio"] == 0.5 and opt["initial_scale"] == 2**5
    assert opt["max_norm"] == 1.0 and isinstance(opt["max_norm"], float)
    assert set(ddp).isdisjoint(opt.keys() - {"verbose"})
    # Every field lands in exactly one of them (device is checked, precision becomes a dtype).
    names = {f for f in GeminiConfig.__dataclass_fields__} - {"loss_scale"}
    names |= set(LOSS_SCALE_KEYWORDS)  # the policy reaches the optimizer as its seven keywords
    assert names - {"precision", "device"} == (ddp.keys() - {"mixed_precision"}) | opt.keys()


BAD: list[tuple[dict[str, Any], type[Exception], str]] = [
    ({"placement_policy": "gpu"}, ValueError, "placement_policy='gpu' is unknown"),
    ({"shard_param_frac": 1.5}, ValueError, "shard_param_frac=1.5 must lie in [0, 1]"),
    ({"offload_optim_frac": "1"}, TypeError, "offload_optim_frac='1' must be a number"),
    ({"offload_param_frac": -0.1}, ValueError, "offload_param_frac=-0.1"),
    ({"placement_policy": "auto", "offload_optim_frac": 0.5}, ValueError, "no effect with"),
    ({"placement_policy": "cpu", "shard_param_frac": 0.5}, ValueError, "needs shard_param"),
    ({"steady_cuda_cap_ratio": 0.5}, ValueError, "no effect with placement_policy='static'"),
    ({"warmup_non_model_data_ratio": 0.5}, ValueError, "=0.5 has no effect"),
    ({"gpu_margin_mem_ratio": 0.2}, ValueError, "gpu_margin_mem_ratio=0.2 needs placement_"),
    ({"placement_policy": "cpu", "gpu_margin_mem_ratio": 0.2}, ValueError, "got 'cpu'"),
    ({"gpu_margin_mem_ratio": 2}, ValueError, "gpu_margin_mem_ratio=2 must lie in [0, 1]"),
    ({"placement_policy": "auto", "steady_cuda_cap_ratio": 0}, ValueError, "no device memory"),
    ({"memstats": object()}, ValueError, "memstats is read by placement_policy='auto' only"),
    ({"offload_param_frac": 0.5, "shard_param_frac": 0.5}, ValueError, "needs shard_param_frac"),
    ({"precision": "fp8"}, ValueError, "precision='fp8' must be one of"),
    ({"pin_memory": 1}, TypeError, "pin_memory=1 must be True or False"),
    ({"strict_ddp_mode": "yes"}, TypeError, "strict_ddp_mode='yes'"),
    ({"force_outputs_fp32": None}, TypeError, "force_outputs_fp32=None"),
    ({"verbose": 0}, TypeError, "verbose=0"),
    ({"search_range_m": 0}, ValueError, "search_range_m=0 must be a positive number"),
    ({"min_chunk_size_m": -1}, ValueError, "min_chunk_size_m=-1"),
    ({"hidden_dim": 0}, ValueError, "hidden_dim=0"),
    ({"hidden_dim": 7.5}, ValueError, "hidden_dim=7.5"),
    ({"chunk_config_dict": [1]}, TypeError, "chunk_config_dict must be a dict"),
    ({"chunk_config_dict": {"chunk_size": 8}, "hidden_dim": 64}, ValueError, "hidden_dim would"),
    ({"chunk_config_dict": {2: {"chunk_size": 8}}}, ValueError, "expected {'chunk_size'"),
    ({"chunk_config_dict": {"chunk_size": 0}}, ValueError, "expected {'chunk_size'"),
    ({"chunk_config_dict": {"chunk_size": 8, "keep_gathered": True}}, NotImplementedError, "keep"),
    ({"chunk_init_device": 3.0}, TypeError, "chunk_init_device=3.0"),
    ({"device": "warp-drive"}, ValueError, "device='warp-drive' is not a device name"),
    ({"initial_scale": 0}, ValueError, "initial_scale"),
    ({"initial_scale": 2**40}, ValueError, "max_scale"),
    ({"growth_interval": 0}, ValueError, "growth_interval"),
    ({"max_norm": -1.0}, ValueError, "max_norm=-1.0 must be a finite number >= 0"),
    ({"max_norm": math.inf}, ValueError, "max_norm=inf"),
    ({"norm_type": 0}, ValueError, "norm_type=0 must be > 0"),
    ({"device_memory_budget": 2**20}, ValueError, "device_memory_budget=1048576 is only"),
    ({"placement_policy": "auto", "device_memory_budget": 0}, ValueError, "budget=0"),
    ({"placement_policy": "auto", "device_memory_budget": 1.5}, TypeError, "budget=1.5"),
    ({"placement_policy": "const", "memstats": object()}, ValueError, "memstats is read"),
    ({"placement_policy": "const", "gpu_margin_mem_ratio": 1.5}, ValueError, "must lie in [0, 1]"),
]


# ids without object addresses, so that pytest-xdist's workers collect the same names
IDS = [str(b[0]).split(" at 0x")[0] for b in BAD]


@pytest.mark.parametrize(("kwargs", "error", "message"), BAD, ids=IDS)
def test_bad_arguments_are_refused_with_their_name(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=re.escape(message)):
        _config(**kwargs)


def test_policy_specific_options_are_accepted_under_their_policy() -> None:
    GeminiConfig(placement_policy="static", shard_param_frac=0.5, offload_optim_frac=1.0)
    GeminiConfig(placement_policy="static", offload_param_frac=1.0, offload_optim_frac=1.0)
    GeminiConfig(
        placement_policy="auto",
        warmup_non_model_data_ratio=0.5,
        steady_cuda_cap_ratio=0.7,
        gpu_margin_mem_ratio=0.3,
        memstats=object(),
    )
    config = GeminiConfig(chunk_config_dict={"chunk_size": 1024}, chunk_init_device="cpu")
    assert config.chunk_init_device == torch.device("cpu")


def test_device_must_be_the_current_one() -> None:
    GeminiConfig(device="cpu").check_device(torch.device("cpu"))
    GeminiConfig(device=None).check_device(torch.device("cuda", 1))
    GeminiConfig(device="cuda").check_device(torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"device=cuda:1 but this process computes on cpu"):
        GeminiConfig(device="cuda:1").check_device(torch.device("cpu"))
    with pytest.raises(ValueError, match=r"device=cuda:0 but this process computes on cuda:1"):
        GeminiConfig(device=0).check_device(torch.device("cuda", 1))


def test_from_ddp_kwargs_reads_the_documents_gemini_config() -> None:
    config = GeminiConfig.from_ddp_kwargs(
        {
            "strict_ddp_mode": True,
            "device": "cpu",
            "placement_policy": "cpu",
            "pin_memory": True,
            "hidden_dim": 768,
            "search_range_mb": 64,
            "min_chunk_size_mb": 1,
            "mixed_precision": torch.bfloat16,
        }
    )
    assert config.precision == "bf16" and config.search_range_m == 64
    assert config.min_chunk_size_m == 1 and config.device == torch.device("cpu")
    with pytest.raises(TypeError, match=r"unknown Gemini model option.*initial_scale.*accepted"):
        GeminiConfig.from_ddp_kwargs({"initial_scale": 2**5})
    with pytest.raises(TypeError, match="both 'search_range_mb' and 'search_range_m'"):
        GeminiConfig.from_ddp_kwargs({"search_range_mb": 1, "search_range_m": 1})
    with pytest.raises(ValueError, match=r"mixed_precision=torch\.int8"):
        GeminiConfig.from_ddp_kwargs({"mixed_precision": torch.int8})


def test_plugin_validates_before_needing_a_process_group() -> None:
    from kolossos.booster.plugin import GeminiPlugin

    with pytest.raises(ValueError, match="placement_policy='gpu' is unknown"):
        GeminiPlugin(placement_policy="gpu")
    with pytest.raises(ValueError, match="device=cuda:1 but this process computes on cpu"):
        GeminiPlugin(device="cuda:1")
    with pytest.raises(RuntimeError, match=r"needs torch\.distributed to be initialised"):
        GeminiPlugin()
