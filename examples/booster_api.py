"""The Booster API tutorial: boost, one training step, sharded safetensors save, load.

A ResNet-18 with ``TorchDDPPlugin`` takes one step on random images (loss: the mean output, with
gradient clipping and a StepLR scheduler), is saved as a Hugging Face-style sharded checkpoint
(``booster.save_model(model, path, True, True, "", 10, use_safetensors=True)``: shards of at most
10 MB plus an index json), and loaded into a fresh ``resnet18()``. The script then checks what the
tutorial promises: the loaded weights equal the saved ones, no shard is over 10 MB, the index is
there.

Run::

    kolossos run --nproc_per_node 1 examples/booster_api.py
    kolossos run --nproc_per_node 2 examples/booster_api.py --output /tmp/booster_api_ckpt

Without ``--output`` the checkpoint goes to a temporary directory (made by rank 0, shared with the
other ranks, removed at the end); with several nodes give an ``--output`` on a shared file system.

Changes from the tutorial (see ``examples/README.md``): imports from ``kolossos``; the model is
``kolossos.models.resnet18``; ``colossalai.launch(config=dict(), rank=rank, world_size=world_size,
port=port, host='localhost')`` (whose arguments the tutorial leaves undefined) became
``kolossos.launch_from_torch(config=dict())``; ``x.to('cuda')`` became
``x.to(get_current_device())``; ``save_path`` is under ``--output`` (tutorial: ``./model``);
``use_safetensors`` (undefined in the tutorial) is a flag, on by default; ``--image_size``
(tutorial: 224) and ``--batch_size`` (tutorial: 4) flags; the checks after loading are new.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.optim import SGD

import kolossos
from kolossos.booster import Booster
from kolossos.booster.plugin import TorchDDPPlugin
from kolossos.models import resnet18
from kolossos.utils import get_current_device, print_rank_0

SIZE_PER_SHARD_MB = 10


def parse_args() -> argparse.Namespace:
    """The launcher's arguments plus this example's flags."""
    parser = kolossos.get_default_parser()
    parser.add_argument("--output", type=str, default=None, help="checkpoint directory")
    parser.add_argument("--batch_size", type=int, default=4, help="tutorial: 4")
    parser.add_argument("--image_size", type=int, default=224, help="tutorial: 224")
    parser.add_argument(
        "--use_safetensors",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="save .safetensors shards (default) or .bin ones",
    )
    return parser.parse_args()


def shared_output_dir(output: str | None) -> tuple[Path, bool]:
    """The directory every rank saves to and loads from, and whether it is a temporary one."""
    if output is not None:
        return Path(output), False
    name = [tempfile.mkdtemp(prefix="kolossos-booster-api-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)  # SYNC POINT: every rank uses rank 0's directory
    return Path(str(name[0])), True


def check_checkpoint(save_path: Path, saved: torch.nn.Module, loaded: torch.nn.Module) -> bool:
    """Print and check the tutorial's promises: equal weights, small shards, an index json."""
    expected = saved.state_dict()
    got = loaded.state_dict()
    equal = expected.keys() == got.keys() and all(
        torch.equal(expected[k].cpu(), got[k].cpu()) for k in expected
    )
    indexes = sorted(save_path.glob("*.index.json"))
    shards: set[str] = set()
    if len(indexes) == 1:
        shards = set(json.loads(indexes[0].read_text())["weight_map"].values())
    sizes = {name: (save_path / name).stat().st_size for name in shards}
    limit = SIZE_PER_SHARD_MB * 1024**2
    print_rank_0(f"index: {', '.join(p.name for p in indexes) or 'MISSING'}")
    for name, size in sorted(sizes.items()):
        print_rank_0(f"shard {name}: {size / 1024**2:.2f} MB")
    print_rank_0(f"loaded weights equal saved ones: {equal}")
    return equal and len(indexes) == 1 and bool(sizes) and max(sizes.values()) <= limit


def train(args: argparse.Namespace) -> bool:
    """The tutorial's ``train()``: boost, one step, save sharded, load into a fresh model."""
    kolossos.launch_from_torch(config=dict())
    plugin = TorchDDPPlugin()
    booster = Booster(plugin=plugin)
    model = resnet18()
    criterion = lambda x: x.mean()  # noqa: E731 (as in the tutorial)
    optimizer = SGD((model.parameters()), lr=0.001)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.1)
    model, optimizer, criterion, _, scheduler = booster.boost(
        model, optimizer, criterion, lr_scheduler=scheduler
    )

    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    x = x.to(get_current_device())
    output = model(x)
    loss = criterion(output)
    booster.backward(loss, optimizer)
    optimizer.clip_grad_by_norm(1.0)
    optimizer.step()
    scheduler.step()

    output_dir, temporary = shared_output_dir(args.output)
    use_safetensors = args.use_safetensors
    save_path = str(output_dir / "model")
    booster.save_model(model, save_path, True, True, "", 10, use_safetensors=use_safetensors)

    new_model = resnet18()
    booster.load_model(new_model, save_path)

    ok = check_checkpoint(Path(save_path), model.unwrap(), new_model)
    dist.barrier()  # SYNC POINT: every rank has read the files before rank 0 removes them
    if temporary and dist.get_rank() == 0:
        shutil.rmtree(output_dir, ignore_errors=True)
    return ok


def main() -> int:
    """Run the tutorial and return 0 when every check passed."""
    ok = train(parse_args())
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
