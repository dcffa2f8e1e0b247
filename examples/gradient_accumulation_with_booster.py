"""Gradient accumulation with the Booster: the "Gradient Accumulation (Latest)" tutorial.

ResNet-18 on CIFAR-10 with ``TorchDDPPlugin``. Every ``GRADIENT_ACCUMULATION``-th iteration steps
the optimizer; the others run forward and backward inside ``booster.no_sync(model)``, so their
gradients only add up locally. The script prints the first parameter element after each iteration:
it stays the same for 3 iterations and changes at the 4th.

Run::

    kolossos run --nproc_per_node 1 examples/gradient_accumulation_with_booster.py
    kolossos run --nproc_per_node 2 examples/gradient_accumulation_with_booster.py --batch_size 16

Changes from the tutorial (see ``examples/README.md``): imports from ``kolossos``; the model is
``kolossos.models.resnet18`` and the data ``kolossos.datasets.CIFAR10`` (real CIFAR-10 under
``$DATA``, otherwise synthetic data of the same shape, with a warning), with the tutorial's
crop/flip/normalise pipeline as one ``ImageTransform``; ``.cuda()`` became
``.to(get_current_device())``; the step condition is ``(idx + 1) % GRADIENT_ACCUMULATION == 0``
(the tutorial's ``idx % (GRADIENT_ACCUMULATION - 1)`` steps at iterations 0, 3, 6, ...); rank 0
prints; ``--batch_size`` (tutorial: 128), ``--steps`` and ``--download`` flags; the exit code says
whether the parameter changed exactly at the accumulation boundaries.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import kolossos
from kolossos.booster import Booster
from kolossos.booster.plugin import TorchDDPPlugin
from kolossos.cluster.dist_coordinator import priority_execution
from kolossos.datasets import CIFAR10, CIFAR10_MEAN, CIFAR10_STD, ImageTransform
from kolossos.models import resnet18
from kolossos.utils import get_current_device, print_rank_0

# define the training hyperparameters
GRADIENT_ACCUMULATION = 4


def parse_args() -> argparse.Namespace:
    """The launcher's arguments plus this example's size flags."""
    parser = kolossos.get_default_parser()
    parser.add_argument("--batch_size", type=int, default=32, help="per rank (tutorial: 128)")
    parser.add_argument(
        "--steps",
        type=int,
        default=GRADIENT_ACCUMULATION,
        help=f"iterations to run (default {GRADIENT_ACCUMULATION}: one accumulation round)",
    )
    parser.add_argument("--download", action="store_true", help="fetch CIFAR-10 if missing")
    return parser.parse_args()


def updated_only_at_boundaries(values: list[str], initial: str) -> bool:
    """Whether the value changed exactly at iterations ``k * GRADIENT_ACCUMULATION - 1``."""
    previous = [initial, *values[:-1]]
    changed = [now != before for now, before in zip(values, previous, strict=True)]
    expected = [(i + 1) % GRADIENT_ACCUMULATION == 0 for i in range(len(values))]
    return changed == expected


def main() -> int:
    """Train ``--steps`` iterations with gradient accumulation and report when parameters moved."""
    # initialize distributed setting
    args = parse_args()
    # launch from torch
    kolossos.launch_from_torch(config=dict())
    BATCH_SIZE = args.batch_size

    # build resnet
    model = resnet18(num_classes=10)

    # build dataloaders
    with priority_execution():
        train_dataset = CIFAR10(
            root=Path(os.environ.get("DATA", "./data")),
            download=args.download,
            # RandomCrop(32, padding=4), RandomHorizontalFlip, ToTensor, Normalize(mean, std)
            transform=ImageTransform(CIFAR10_MEAN, CIFAR10_STD, crop_padding=4, flip=True),
        )

    # build criterion
    criterion = torch.nn.CrossEntropyLoss()

    # optimizer
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)

    plugin = TorchDDPPlugin()
    booster = Booster(plugin=plugin)
    train_dataloader = plugin.prepare_dataloader(
        train_dataset, batch_size=BATCH_SIZE, shuffle=True, drop_last=True
    )
    model, optimizer, criterion, train_dataloader, _ = booster.boost(
        model=model, optimizer=optimizer, criterion=criterion, dataloader=train_dataloader
    )

    initial = str(next(model.parameters()).flatten()[0].item())
    param_by_iter: list[str] = []
    optimizer.zero_grad()
    for idx, (img, label) in enumerate(train_dataloader):
        sync_context = booster.no_sync(model)
        img = img.to(get_current_device())
        label = label.to(get_current_device())
        if (idx + 1) % GRADIENT_ACCUMULATION != 0:
            with sync_context:
                output = model(img)
                train_loss = criterion(output, label)
                booster.backward(train_loss, optimizer)
        else:
            output = model(img)
            train_loss = criterion(output, label)
            booster.backward(train_loss, optimizer)
            optimizer.step()
            optimizer.zero_grad()

        ele_1st = next(model.parameters()).flatten()[0]
        param_by_iter.append(str(ele_1st.item()))

        if idx + 1 == args.steps:
            break

    for iteration, val in enumerate(param_by_iter):
        print_rank_0(f"iteration {iteration} - value: {val}")

    ok = updated_only_at_boundaries(param_by_iter, initial)
    if ok:
        print_rank_0("The parameter is only updated in the last iteration")
    else:
        print_rank_0(f"UNEXPECTED: the parameter did not change only every {GRADIENT_ACCUMULATION}")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
