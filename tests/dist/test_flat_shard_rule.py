"""ZeRO engines refuse optimizers that need whole parameters (LAMB's trust ratio over a flat
shard trained a different model than one process: 0.01046 vs 0.00997 after 3 steps), and keep
taking element-wise ones."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from kolossos.booster import Booster
from kolossos.booster.plugin import GeminiPlugin, HybridParallelPlugin, LowLevelZeroPlugin
from kolossos.nn.optimizer import FusedLAMB, HybridAdam, Lamb, Lars
from kolossos.nn.optimizer.flat_shards import check_flat_shard_safe
from kolossos.testing import distributed


def _params() -> list[nn.Parameter]:
    return list(nn.Linear(4, 4).parameters())


@pytest.mark.parametrize("cls", [Lamb, Lars, FusedLAMB, torch.optim.LBFGS])
def test_per_parameter_optimizers_are_refused(cls: type[torch.optim.Optimizer]) -> None:
    with pytest.raises(ValueError, match=f"{cls.__name__} computes per-parameter"):
        check_flat_shard_safe(cls(_params()), "LowLevelZeroOptimizer")


@pytest.mark.parametrize(
    "cls", [torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, HybridAdam]
)  # fmt: skip
def test_element_wise_optimizers_pass(cls: type[torch.optim.Optimizer]) -> None:
    kwargs = {"lr": 0.1} if cls is torch.optim.SGD else {}
    check_flat_shard_safe(cls(_params(), **kwargs), "Gemini")


@distributed(2)
def test_plugins_refuse_lamb_on_every_rank() -> None:
    """ZeRO's flat shards and tensor-parallel slices alike."""
    plugins = (
        LowLevelZeroPlugin(stage=2, precision="fp32"),
        GeminiPlugin(),
        HybridParallelPlugin(tp_size=2, pp_size=1, precision="fp32"),
    )
    for plugin in plugins:
        model = nn.Linear(4, 4)
        with pytest.raises(ValueError, match="shards that cut across"):
            Booster(plugin=plugin).boost(model, Lamb(model.parameters()))
