"""Gradient handlers with the legacy engine: the "Gradient Handler" tutorial.

ResNet-18 on CIFAR-10 through ``kolossos.initialize``. ``config.py`` selects two gradient
handlers, which ``engine.step()`` runs in order before the optimizer step:
``DataParallelGradientHandler`` (the tutorial's replacement for torch DDP) averages the gradients
over the data-parallel ranks, then ``MyGradientHandler``, written here with the tutorial's recipe
(subclass ``BaseGradientHandler``, register it in ``GRADIENT_HANDLER``, implement
``handle_gradient``), checks that every data-parallel rank now holds the same gradients and logs
it.

Run::

    kolossos run --nproc_per_node 4 examples/legacy/gradient_handler/train.py \\
        --config examples/legacy/gradient_handler/config.py

Changes from the tutorial: imports from ``kolossos``; the tutorial's ``do_something()`` became a
check of the data-parallel gradients; the model is ``kolossos.models.resnet18`` and the data
``kolossos.datasets.CIFAR10`` (real CIFAR-10 under ``$DATA``, otherwise a synthetic stand-in of the
same shape, with a warning); ``.cuda()`` became ``.to(get_current_device())``; ``--config``
defaults to the ``config.py`` next to this file; each epoch stops after ``STEPS_PER_EPOCH``
iterations; the exit code is 1 if the handler never ran, found different gradients, or the ranks
end with different parameters.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import kolossos
from kolossos.context import ParallelMode
from kolossos.core import global_context as gpc
from kolossos.datasets import CIFAR10, CIFAR10_MEAN, CIFAR10_STD, ImageTransform
from kolossos.engine.gradient_handler import BaseGradientHandler
from kolossos.logging import get_dist_logger
from kolossos.models import resnet18
from kolossos.registry import GRADIENT_HANDLER
from kolossos.utils import get_current_device, get_dataloader

HERE = Path(__file__).resolve().parent


def same_on_data_ranks(tensors: list[torch.Tensor]) -> bool:
    """Whether ``tensors`` are bitwise identical on every data-parallel rank (a collective)."""
    local = torch.cat([t.detach().flatten().float() for t in tensors])
    reference = local.clone()
    src = gpc.get_ranks_in_group(ParallelMode.DATA)[0]
    dist.broadcast(reference, src=src, group=gpc.get_group(ParallelMode.DATA))
    agree = torch.tensor([float(torch.equal(local, reference))])
    dist.all_reduce(agree, op=dist.ReduceOp.MIN, group=gpc.get_group(ParallelMode.DATA))
    return bool(agree.item())


@GRADIENT_HANDLER.register_module
class MyGradientHandler(BaseGradientHandler):
    """Runs after ``DataParallelGradientHandler``: checks that the gradients agree on every
    data-parallel rank and logs the result."""

    calls = 0
    all_synchronised = True

    def handle_gradient(self) -> None:
        """Check the gradients of this step (a collective over the data-parallel group)."""
        grads = [p.grad for p in self._model.parameters() if p.grad is not None]
        synchronised = same_on_data_ranks(grads)
        MyGradientHandler.calls += 1
        MyGradientHandler.all_synchronised &= synchronised
        get_dist_logger().info(
            f"MyGradientHandler call {MyGradientHandler.calls}: gradients identical on all "
            f"{gpc.get_world_size(ParallelMode.DATA)} data-parallel ranks: {synchronised}",
            ranks=[0],
        )


def main() -> int:
    """Train a few iterations with the two handlers; fail if they did not do their job."""
    parser = kolossos.get_default_parser()
    parser.set_defaults(config=str(HERE / "config.py"))
    args = parser.parse_args()
    kolossos.launch_from_torch(config=args.config)
    logger = get_dist_logger()

    # build resnet
    model = resnet18(num_classes=10)

    # build dataloaders
    train_dataset = CIFAR10(
        root=Path(os.environ.get("DATA", "./data")),
        transform=ImageTransform(CIFAR10_MEAN, CIFAR10_STD, crop_padding=4, flip=True),
        synthetic_size=1024,
    )
    train_dataloader = get_dataloader(
        dataset=train_dataset,
        shuffle=True,
        batch_size=gpc.config.BATCH_SIZE,
        pin_memory=True,
    )

    # build criterion and optimizer
    criterion = torch.nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)

    engine, train_dataloader, _, _ = kolossos.initialize(
        model, optimizer, criterion, train_dataloader
    )
    handlers = [type(h).__name__ for h in engine.gradient_handlers]
    logger.info(f"gradient handlers: {handlers}", ranks=[0])
    logger.info(f"torch DDP used: {isinstance(engine.model, DDP)}", ranks=[0])

    engine.train()
    for epoch in range(gpc.config.NUM_EPOCHS):
        for idx, (img, label) in enumerate(train_dataloader):
            img = img.to(get_current_device())
            label = label.to(get_current_device())

            engine.zero_grad()
            output = engine(img)
            train_loss = engine.criterion(output, label)
            engine.backward(train_loss)
            engine.step()
            logger.info(f"epoch {epoch} iteration {idx}: loss {train_loss.item():.4f}", ranks=[0])
            if idx + 1 == gpc.config.STEPS_PER_EPOCH:
                break

    same_params = same_on_data_ranks(list(model.parameters()))
    logger.info(f"parameters identical on all data-parallel ranks: {same_params}", ranks=[0])
    ok = MyGradientHandler.calls > 0 and MyGradientHandler.all_synchronised and same_params
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
