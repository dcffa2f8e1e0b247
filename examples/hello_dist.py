"""Hello, distributed world: every rank all-reduces ``rank + 1`` and checks the sum.

Run it on one node with four processes::

    kolossos run --nproc_per_node 4 examples/hello_dist.py

or on two nodes listed in a hostfile (see docs/launch.md)::

    kolossos run --nproc_per_node 2 --hostfile hostfile --master_addr node1 examples/hello_dist.py

Each rank prints one line; the script exits non-zero if a rank sees a wrong sum.
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist

import kolossos
from kolossos.accelerator import get_accelerator


def main() -> int:
    """Initialise from the launcher's environment, all-reduce ``rank + 1`` and check the result."""
    kolossos.launch_from_torch(config={}, verbose=False)
    try:
        rank, world_size = dist.get_rank(), dist.get_world_size()
        device = get_accelerator().get_current_device()  # cpu with gloo, cuda:LOCAL_RANK with nccl
        value = torch.tensor([float(rank + 1)], device=device)
        dist.all_reduce(value)  # sum over all ranks of all nodes
        expected = world_size * (world_size + 1) // 2
        ok = int(value.item()) == expected
        line = (
            f"rank {rank}/{world_size} (local rank {os.environ.get('LOCAL_RANK')}, "
            f"host {socket.gethostname()}): all_reduce(rank + 1) = {int(value.item())}, "
            f"expected {expected}: {'OK' if ok else 'WRONG'}\n"
        )
        print(line, end="", flush=True)  # one write, so lines of different ranks do not mix
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
