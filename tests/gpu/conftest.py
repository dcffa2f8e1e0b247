"""Fixtures of the GPU tests."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from kolossos.testing import free_port


@pytest.fixture(scope="module")
def nccl_group() -> Iterator[None]:
    """A single-rank NCCL group on GPU 0 (as under ``torchrun --nproc_per_node=1``: one GPU
    cannot host two NCCL ranks), with TF32 off so that fp32 compares tightly; both undone after
    the module."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    torch.cuda.set_device(0)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
