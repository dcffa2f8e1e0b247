"""fp16 loss-scaler state survives an optimizer checkpoint, for every fp16 path.

The scaler is driven into a state no fresh optimizer has (scale, growth tracker and hysteresis
budget all changed), saved with the optimizer, and loaded into a freshly boosted optimizer: the
state must be restored exactly. Without it a resumed fp16 run would restart from the initial
scale and skip steps the uninterrupted run does not.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kolossos.booster import Booster
from kolossos.booster.plugin import GeminiPlugin, LowLevelZeroPlugin, TorchDDPPlugin
from kolossos.checkpoint_io.optimizer_io import find_loss_scaler
from kolossos.testing import distributed, parameterize
from kolossos.testing.parity import TinyMLP

CHANGED = {"scale": 96.0, "growth_tracker": 7, "hysteresis_tracker": 1}

BOOSTERS: dict[str, Callable[[], Booster]] = {
    "ddp-fp16": lambda: Booster(mixed_precision="fp16", plugin=TorchDDPPlugin()),
    "zero2-fp16": lambda: Booster(plugin=LowLevelZeroPlugin(stage=2, precision="fp16")),
    "gemini-fp16": lambda: Booster(plugin=GeminiPlugin(precision="fp16")),
}


def boosted_optimizer(kind: str) -> Any:
    torch.manual_seed(0)
    model = TinyMLP()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _, boosted, *_ = BOOSTERS[kind]().boost(model, optimizer)
    return boosted


@distributed(2)
def test_fp16_loss_scaler_state_round_trips(tmp_path: Path) -> None:
    root = [str(tmp_path)]
    dist.broadcast_object_list(root, src=0)

    @parameterize("kind", list(BOOSTERS))
    @parameterize("shard", [False, True])
    def case(kind: str, shard: bool) -> None:
        saved = boosted_optimizer(kind)
        scaler = find_loss_scaler(saved)
        assert scaler is not None, kind
        state = scaler.state_dict()
        state.update({k: v for k, v in CHANGED.items() if k in state})
        scaler.load_state_dict(state)
        path = str(Path(root[0]) / f"{kind}-{shard}" / ("optim" if shard else "optim.pt"))
        booster = BOOSTERS[kind]()
        booster.save_optimizer(saved, path, shard=shard)
        dist.barrier()
        fresh = boosted_optimizer(kind)
        fresh_scaler = find_loss_scaler(fresh)
        assert fresh_scaler is not None
        assert fresh_scaler.state_dict() != scaler.state_dict()  # the test can fail
        booster.load_optimizer(fresh, path)
        assert fresh_scaler.state_dict() == scaler.state_dict(), kind

    case()
