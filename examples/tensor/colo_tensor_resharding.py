"""The ColoTensor concepts example (docs "ColoTensor Concepts"): a tensor sharded on its last
dimension over the tensor-parallel group, gathered with ``to_replicate()``, then resharded on
dimension 0 with ``set_dist_spec``, on 4 processes with ``tp_degree=2, dp_degree=2``.

Run::

    python examples/tensor/colo_tensor_resharding.py

Changes from the docs: imports from ``kolossos``; ``backend='nccl'`` became
``backend=None`` (nccl with CUDA, gloo without) and ``.cuda()`` became
``.to(get_current_device())``; the docs' text says 8 GPUs with tp=4 but the code uses 4 with tp=2
(kept). kolossos' ColoTensor reports the *global* shape (a DTensor); Colossal-AI printed this
rank's piece, which the added ``local shape`` lines show.
"""

import torch

import kolossos
from kolossos.tensor import (
    ColoTensor,
    ColoTensorSpec,
    ComputePattern,
    ComputeSpec,
    ProcessGroup,
    ShardSpec,
)
from kolossos.testing import spawn
from kolossos.utils import get_current_device, print_rank_0


def run_dist_tests(rank, world_size, port):
    kolossos.launch(
        config={}, rank=rank, world_size=world_size, host="localhost", port=port, backend=None
    )
    pg = ProcessGroup(tp_degree=2, dp_degree=2)

    torch.manual_seed(0)
    local_tensor = torch.randn(2, 3, 1).to(get_current_device())
    print_rank_0(f"shape {local_tensor.shape}, {local_tensor.data}")

    spec = ColoTensorSpec(
        pg,
        ShardSpec(dims=[-1], num_partitions=[pg.tp_world_size()]),
        ComputeSpec(ComputePattern.TP1D),
    )
    t1 = ColoTensor.from_torch_tensor(local_tensor, spec)
    print_rank_0(f"local shape {t1.size_local()} (sharded on dim -1)")
    t1 = t1.to_replicate()
    print_rank_0(f"shape {t1.shape}, {t1.data}")
    print_rank_0(f"local shape {t1.size_local()} (replicated)")

    spec2 = ShardSpec([0], [pg.tp_world_size()])
    t1.set_dist_spec(spec2)
    print_rank_0(f"shape {t1.shape}, {t1.data}")
    print_rank_0(f"local shape {t1.size_local()} (sharded on dim 0)")
    print_rank_0(f"local values {t1.to_local().flatten().tolist()}")


def test_dist_cases(world_size):
    spawn(run_dist_tests, world_size)


if __name__ == "__main__":
    test_dist_cases(4)
