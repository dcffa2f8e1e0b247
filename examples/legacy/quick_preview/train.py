"""The README's quick preview: "distributed training in a few lines" with the legacy engine.

``kolossos.launch`` with explicit ``rank``, ``world_size``, ``backend``, ``port`` and ``host``;
``get_dataloader`` (which adds the data-parallel sampler); ``kolossos.initialize``; and the engine
loop ``zero_grad / engine(data) / engine.criterion / backward / step``. The model is the README's
two-layer MLP with tensor-parallel layers: with ``config_2d.py``
(``parallel = dict(tensor=dict(size=4, mode='2d'))``, 4 processes) the README's ``MLP_2D`` of
``Linear2D`` layers, each rank holding one (in/2, out/2) block of each weight and one block of
the batch; with ``config.py`` (``mode='1d'``, 2 processes) ``kolossos.nn.Linear``, column- then
row-parallel, each rank holding half of each weight.

Run (any launcher that sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``, or
pass ``--rank``, ``--world_size``, ``--host`` and ``--port``)::

    kolossos run --nproc_per_node 4 examples/legacy/quick_preview/train.py \\
        --config examples/legacy/quick_preview/config_2d.py
    kolossos run --nproc_per_node 2 examples/legacy/quick_preview/train.py \\
        --config examples/legacy/quick_preview/config.py

Changes from the README: imports from ``kolossos``; ``rank``, ``world_size``, ``port`` and
``host`` (undefined in the README) come from the arguments or the launcher's environment;
``backend`` is ``--backend`` or, by default, nccl with CUDA and gloo without (the README writes
``'nccl'``); the dataset is a synthetic regression task (the targets are a fixed random linear map
of the inputs) with the mean squared error (in 2D each rank holds a block of the outputs, so its
loss is its blocks' squared error over the whole batch's element count, which makes the sum of
the ranks' losses the global mean and its gradients exact); rank 0 logs the weight shapes and
each epoch's mean loss; the exit code is 1 if a loss was not finite or the loss did not fall.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import TensorDataset

import kolossos
import kolossos.nn as col_nn
from kolossos.context import ParallelMode
from kolossos.core import global_context as gpc
from kolossos.logging import get_dist_logger
from kolossos.nn import Linear2D
from kolossos.utils import get_current_device, get_dataloader

HERE = Path(__file__).resolve().parent


class MLP_2D(nn.Module):
    """The README's model: two ``Linear2D`` layers (2D tensor parallelism)."""

    def __init__(self, in_features: int, hidden_features: int) -> None:
        super().__init__()
        self.linear_1 = Linear2D(in_features=in_features, out_features=hidden_features)
        self.linear_2 = Linear2D(in_features=hidden_features, out_features=in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear_1(x)
        x = self.linear_2(x)
        return x


class MLP_1D(nn.Module):
    """The README's ``MLP_2D`` with the 1D layers: ``Linear`` follows ``parallel.tensor``."""

    def __init__(self, in_features: int, hidden_features: int) -> None:
        super().__init__()
        self.linear_1 = col_nn.Linear(in_features=in_features, out_features=hidden_features)
        self.linear_2 = col_nn.Linear(in_features=hidden_features, out_features=in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear_1(x)
        x = self.linear_2(x)
        return x


def block_2d(x: torch.Tensor) -> torch.Tensor:
    """This rank's block of ``x``, as the 2D page partitions its input: rows by the rank in the
    2D column group, features by the rank in the 2D row group."""
    q = gpc.get_world_size(ParallelMode.PARALLEL_2D_COL)
    x = torch.chunk(x, q, dim=0)[gpc.get_local_rank(ParallelMode.PARALLEL_2D_COL)]
    return torch.chunk(x, q, dim=-1)[gpc.get_local_rank(ParallelMode.PARALLEL_2D_ROW)]


class BlockMSE(nn.Module):
    """Squared error of this rank's output block over the element count of all ``blocks``."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.blocks = blocks

    def forward(self, output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return ((output - label) ** 2).sum() / (output.numel() * self.blocks)


def synthetic_dataset(samples: int, features: int) -> TensorDataset:
    """Inputs and targets ``x @ teacher``, identical in every process (fixed seed)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(samples, features, generator=gen)
    teacher = torch.randn(features, features, generator=gen) / math.sqrt(features)
    return TensorDataset(x, x @ teacher)


def main() -> int:
    """Train the MLP for ``NUM_EPOCHS`` epochs; fail unless the loss is finite and falls."""
    parser = kolossos.get_default_parser()
    # an argument given on the command line wins over the launcher's environment
    parser.set_defaults(config=str(HERE / "config.py"), host=None, port=None)
    args = parser.parse_args()
    my_config = args.config
    rank = args.rank if args.rank is not None else int(os.environ["RANK"])
    world_size = args.world_size if args.world_size is not None else int(os.environ["WORLD_SIZE"])
    host = args.host if args.host is not None else os.environ.get("MASTER_ADDR", "localhost")
    port = args.port if args.port is not None else int(os.environ.get("MASTER_PORT", "29500"))

    # my_config can be the path of a config file or a dict;
    # 'localhost' only works on a single node: name the master node with several nodes
    kolossos.launch(
        config=my_config,
        rank=rank,
        world_size=world_size,
        backend=args.backend,
        port=port,
        host=host,
    )
    logger = get_dist_logger()
    cfg = gpc.config

    # build the model
    two_d = cfg.parallel.tensor.mode == "2d"
    model = (MLP_2D if two_d else MLP_1D)(cfg.IN_FEATURES, cfg.HIDDEN_FEATURES)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    logger.info(f"rank {rank} parameter shapes: {shapes}")

    # build the dataset; the dataloader adds the distributed (data-parallel) sampler
    dataset = synthetic_dataset(cfg.NUM_SAMPLES, cfg.IN_FEATURES)
    train_dataloader = get_dataloader(dataset=dataset, shuffle=True, batch_size=cfg.BATCH_SIZE)

    # build the optimizer and the loss function
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    criterion: nn.Module = nn.MSELoss()
    if two_d:  # this rank's blocks' share of the mean over the whole batch
        criterion = BlockMSE(gpc.get_world_size(ParallelMode.TENSOR))

    # initialize kolossos
    engine, train_dataloader, _, _ = kolossos.initialize(
        model=model, optimizer=optimizer, criterion=criterion, train_dataloader=train_dataloader
    )

    # train
    epoch_losses = []
    engine.train()
    for epoch in range(cfg.NUM_EPOCHS):
        losses = []
        for data, label in train_dataloader:
            data, label = data.to(get_current_device()), label.to(get_current_device())
            if two_d:  # each rank takes its block of the batch (rows) and of the features
                data, label = block_2d(data), block_2d(label)
            engine.zero_grad()
            output = engine(data)
            loss = engine.criterion(output, label)
            engine.backward(loss)
            engine.step()
            if two_d:  # the ranks' shares add up to the mean over the whole batch
                loss = loss.detach().clone()
                dist.all_reduce(loss, group=gpc.get_group(ParallelMode.TENSOR))
            losses.append(loss.item())
        epoch_losses.append(sum(losses) / len(losses))
        logger.info(f"epoch {epoch}: mean loss {epoch_losses[-1]:.6f}", ranks=[0])

    ok = all(math.isfinite(x) for x in epoch_losses) and epoch_losses[-1] < epoch_losses[0]
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
