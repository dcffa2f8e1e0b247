"""Checkpoint IO across processes: rank 0 writes, every rank waits for it, every rank loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from kolossos.checkpoint_io import (
    CheckpointError,
    GeneralCheckpointIO,
    atomic,
    register_param_names,
)
from kolossos.testing import distributed

pytest.importorskip("safetensors")


def build(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.LayerNorm(16))


def trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = build(seed)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    register_param_names(opt, model)
    model(torch.ones(4, 16)).pow(2).sum().backward()
    opt.step()
    return model, opt


def same_state(a: nn.Module, b: nn.Module) -> bool:
    pairs = zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    return all(torch.equal(x, y) for x, y in pairs)


@pytest.mark.parametrize("world_size", [2, 3])
@distributed()
def test_rank0_writes_everyone_waits_and_loads(world_size: int, tmp_path: Path) -> None:
    rank = dist.get_rank()
    commits: list[Path] = []
    atomic._ON_FILE_COMMITTED.append(commits.append)
    io = GeneralCheckpointIO()
    model, opt = trained(0)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    sched.step()
    io.save_model(model, tmp_path / "m", shard=True, size_per_shard=0.002, use_safetensors=True)
    # save_model returned, so the checkpoint is complete for every rank
    assert (tmp_path / "m" / "model.safetensors.index.json").is_file()
    io.save_optimizer(opt, tmp_path / "o", shard=True, size_per_shard=0.002)
    assert (tmp_path / "o" / "pytorch_optim.bin.index.json").is_file()
    io.save_lr_scheduler(sched, tmp_path / "s.bin")
    assert (len(commits) > 0) == (rank == 0), commits  # only rank 0 wrote files

    fresh, fresh_opt = trained(1)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, 1)
    io.load_model(fresh, tmp_path / "m")
    io.load_optimizer(fresh_opt, tmp_path / "o")
    io.load_lr_scheduler(fresh_sched, tmp_path / "s.bin")
    assert same_state(fresh, model)
    assert fresh_sched.get_last_lr() == sched.get_last_lr()
    state = fresh_opt.state[fresh[0].weight]
    torch.testing.assert_close(state["exp_avg"], opt.state[model[0].weight]["exp_avg"])


@distributed(2)
def test_a_failing_writer_fails_every_rank(tmp_path: Path) -> None:
    io = GeneralCheckpointIO()
    model = build(0)
    io.save_model(model, tmp_path / "m", shard=True, size_per_shard=0.002)

    def disk_full(_: Path) -> None:
        raise OSError(28, "No space left on device")

    if dist.get_rank() == 0:
        atomic._ON_FILE_COMMITTED.append(disk_full)
        with pytest.raises(OSError, match="No space left"):
            io.save_model(build(1), tmp_path / "m", shard=True, size_per_shard=0.002)
        atomic._ON_FILE_COMMITTED.remove(disk_full)
    else:  # rank 1 learns about it instead of waiting forever
        with pytest.raises(CheckpointError, match="failed on rank 0: OSError"):
            io.save_model(build(1), tmp_path / "m", shard=True, size_per_shard=0.002)
    fresh = build(2)
    io.load_model(fresh, tmp_path / "m")  # the previous checkpoint is intact
    assert same_state(fresh, model)


@distributed(2)
def test_tensor_parallel_dtensors_gather_and_reslice(tmp_path: Path) -> None:
    """DTensor state (torch tensor parallelism) is saved whole and re-sliced at load."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2,))
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    reference, ref_opt = trained(0)  # the same training, unsharded
    tp = parallelize_module(build(0), mesh, plan)
    tp_opt = torch.optim.Adam(tp.parameters(), lr=0.01)
    register_param_names(tp_opt, tp)
    tp(torch.ones(4, 16)).pow(2).sum().backward()
    tp_opt.step()

    io = GeneralCheckpointIO()
    io.save_model(tp, tmp_path / "m", shard=True, size_per_shard=0.002)
    io.save_optimizer(tp_opt, tmp_path / "o", shard=True, size_per_shard=0.002)
    # 2 tensor-parallel ranks -> 1 plain model
    plain, plain_opt = trained(5)
    io.load_model(plain, tmp_path / "m")
    io.load_optimizer(plain_opt, tmp_path / "o")
    expected = reference.state_dict().values()
    for (name, got), want in zip(plain.state_dict().items(), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=name)
    torch.testing.assert_close(
        plain_opt.state[plain[0].weight]["exp_avg_sq"],
        ref_opt.state[reference[0].weight]["exp_avg_sq"],
        rtol=1e-6,
        atol=1e-9,
    )
    # ... and back into a fresh tensor-parallel model: each rank gets its slice
    tp2 = parallelize_module(build(9), mesh, plan)
    tp2_opt = torch.optim.Adam(tp2.parameters(), lr=0.01)
    register_param_names(tp2_opt, tp2)
    io.load_model(tp2, tmp_path / "m")
    io.load_optimizer(tp2_opt, tmp_path / "o")

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    for (name, got), want in zip(tp2.state_dict().items(), tp.state_dict().values(), strict=True):
        assert torch.equal(local(got), local(want)), name
    got_state, want_state = tp2_opt.state[tp2[0].weight], tp_opt.state[tp[0].weight]
    assert type(got_state["exp_avg"]) is type(want_state["exp_avg"])  # a DTensor again
    assert torch.equal(local(got_state["exp_avg"]), local(want_state["exp_avg"]))
