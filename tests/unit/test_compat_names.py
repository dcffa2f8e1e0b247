"""Names Colossal-AI users import (issue 19, item 7), without a process group: ``Accelerator``,
``DeviceMesh`` arithmetic, ``DeviceMeshInfo``, the lazy ``HybridParallelCheckpointIO`` export,
``multi_tensor_applier`` and its ops, ``FusedSGD``, ``FusedLAMB``, and the unsharded
``DistributedLamb`` / ``DistributedAdaFactor`` (the sharded runs are in
``tests/dist/test_distributed_optimizers.py``).

Tolerances: FusedSGD equals ``torch.optim.SGD`` bit for bit (the same ops in the same order);
FusedLAMB and the unsharded distributed optimizers match their references within fp32 rounding
(``rtol=1e-6, atol=1e-7``; DistributedLamb, whose norms are ``sqrt(sum(x²))`` rather than
``vector_norm``, ``rtol=1e-5, atol=1e-6``; Hugging Face's Adafactor in fp64
``rtol=1e-12, atol=1e-14``).
"""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from kolossos.booster.accelerator import Accelerator
from kolossos.cluster import DeviceMeshInfo
from kolossos.cluster.device_mesh_manager import initialize_device_mesh
from kolossos.device.device_mesh import DeviceMesh
from kolossos.nn.optimizer import DistributedAdaFactor, DistributedLamb, FusedLAMB, FusedSGD, Lamb
from kolossos.utils.multi_tensor_apply import (
    MultiTensorApply,
    multi_tensor_applier,
    multi_tensor_l2norm,
    multi_tensor_scale,
)

RTOL, ATOL = 1e-6, 1e-7


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3), nn.LayerNorm(3)).to(dtype)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 5) -> None:
    gen = torch.Generator().manual_seed(7)
    dtype = next(model.parameters()).dtype
    for _ in range(steps):
        x = torch.randn(5, 6, generator=gen).to(dtype)
        opt.zero_grad()
        model(x).pow(2).mean().mul(10).backward()
        opt.step()


def assert_params(
    a: nn.Module,
    b: nn.Module,
    moved_from: nn.Module | None = None,
    rtol: float = RTOL,
    atol: float = ATOL,
) -> None:
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol)
    if moved_from is not None:
        moved = max(
            (p - q).abs().max().item()
            for p, q in zip(a.parameters(), moved_from.parameters(), strict=True)
        )
        assert moved > 1e-3


def run_pair(
    make_a: Callable[..., torch.optim.Optimizer],
    make_b: Callable[..., torch.optim.Optimizer],
    dtype: torch.dtype = torch.float32,
) -> tuple[nn.Module, nn.Module, nn.Module]:
    start = make_model(dtype=dtype)
    a, b = copy.deepcopy(start), copy.deepcopy(start)
    train(a, make_a(a.parameters()))
    train(b, make_b(b.parameters()))
    return a, b, start


# ---- Accelerator ---------------------------------------------------------------------------


def test_accelerator_moves_model_to_its_device() -> None:
    acc = Accelerator("cpu")
    acc.bind()
    model = acc.configure_model(nn.Linear(2, 2))
    assert acc.device == "cpu" and next(model.parameters()).device.type == "cpu"
    with pytest.raises(ValueError, match="not supported"):
        Accelerator("meta")
    with pytest.raises(ValueError, match="not a device name"):
        Accelerator("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="device='cpu'"):
            Accelerator("cuda")


# ---- DeviceMesh ----------------------------------------------------------------------------


def test_device_mesh_arithmetic_as_upstream() -> None:
    """Colossal-AI's ``tests/test_device/test_device_mesh.py::test_device_mesh``."""
    mesh = DeviceMesh(torch.arange(0, 16), (4, 4))
    assert mesh.global_rank_to_local_rank(5) == [1, 1]
    assert mesh.global_rank_to_local_rank(11) == [2, 3]
    assert mesh.global_rank_to_local_rank(11, axis=0) == 2
    assert mesh.get_ranks_in_process_group(axis=1, global_rank=2) == [0, 1, 2, 3]
    assert mesh.get_ranks_in_process_group(axis=0, global_rank=2) == [2, 6, 10, 14]
    assert mesh.shape == (4, 4) and mesh.num_devices == 16 and not mesh.is_initialized
    flat = mesh.flatten()
    assert flat.shape == (16,) and flat.get_ranks_in_process_group(0, 3) == list(range(16))
    assert mesh.all_reduce_cost(1000, 0) > mesh.all_gather_cost(1000, 0)


def test_device_mesh_logical_ids_and_errors() -> None:
    logical = torch.tensor([[3, 1], [2, 0]])
    mesh = DeviceMesh(torch.arange(4), logical_mesh_id=logical, device="cpu")
    assert mesh.shape == torch.Size([2, 2]) and torch.equal(mesh.logical_mesh_id, logical)  # type: ignore[arg-type]
    assert mesh.global_rank_to_local_rank(0) == [1, 1]
    assert mesh.get_ranks_in_process_group(0, global_rank=3) == [3, 2]
    with pytest.raises(ValueError, match="exactly one"):
        DeviceMesh(torch.arange(4))
    with pytest.raises(ValueError, match="holds 6 devices"):
        DeviceMesh(torch.arange(4), (2, 3))
    with pytest.raises(ValueError, match="repeats"):
        DeviceMesh(torch.tensor([0, 0]), (2,))
    with pytest.raises(ValueError, match="device='tpu'"):
        DeviceMesh(torch.arange(2), (2,), device="tpu")
    with pytest.raises(RuntimeError, match="do not exist yet"):
        mesh.get_process_group(0, global_rank=0)
    assert copy.deepcopy(mesh).global_rank_to_local_rank(3) == [0, 0]


def test_device_mesh_info_checks_and_profiling_search_is_refused() -> None:
    with pytest.raises(ValueError, match="holds 6 devices"):
        DeviceMeshInfo(physical_ids=[0, 1, 2, 3], mesh_shape=(2, 3))
    with pytest.raises(NotImplementedError, match="mesh_shape"):
        initialize_device_mesh(DeviceMeshInfo(physical_ids=[0, 1]))


# ---- lazy HybridParallelCheckpointIO -----------------------------------------------------


def test_hybrid_checkpoint_io_is_a_lazy_export() -> None:
    code = (
        "import sys, kolossos.checkpoint_io as c\n"
        "assert 'kolossos.hybrid' not in sys.modules\n"
        "from kolossos.checkpoint_io import HybridParallelCheckpointIO\n"
        "from kolossos.hybrid.checkpoint_io import HybridParallelCheckpointIO as H\n"
        "assert HybridParallelCheckpointIO is H and 'HybridParallelCheckpointIO' in dir(c)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- multi_tensor_applier -------------------------------------------------------------------


def test_multi_tensor_scale_and_l2norm() -> None:
    flag = torch.zeros(1, dtype=torch.int)
    src = [torch.randn(5), torch.randn(2, 3)]
    dst = [torch.empty(5, dtype=torch.float16), torch.empty(2, 3, dtype=torch.float16)]
    multi_tensor_applier(multi_tensor_scale, flag, [src, dst], 0.5)
    for s, d in zip(src, dst, strict=True):
        torch.testing.assert_close(d, (s * 0.5).half())
    assert int(flag) == 0
    norm, per = multi_tensor_applier(multi_tensor_l2norm, flag, [src], True)
    expected = torch.linalg.vector_norm(torch.cat([t.reshape(-1) for t in src]))
    torch.testing.assert_close(norm, expected.reshape(1), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(per, torch.stack([t.norm() for t in src]), rtol=RTOL, atol=ATOL)
    assert multi_tensor_applier(multi_tensor_l2norm, flag, [src], False)[1].numel() == 0
    bad = [torch.tensor([1.0, float("inf")])]
    multi_tensor_applier(multi_tensor_scale, flag, [bad, bad], 2.0)
    assert int(flag) == 1
    with pytest.raises(ValueError, match="chunk_size"):
        MultiTensorApply(0)
    with pytest.raises(ValueError, match="2 tensor list"):
        multi_tensor_applier(multi_tensor_scale, flag, [src], 1.0)


# ---- FusedSGD ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"momentum": 0.9},
        {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
        {"momentum": 0.8, "dampening": 0.2, "weight_decay": 0.1},
    ],
)
def test_fused_sgd_equals_torch_sgd(kw: dict[str, Any]) -> None:
    a, b, start = run_pair(
        lambda p: FusedSGD(p, lr=0.05, **kw), lambda p: torch.optim.SGD(p, lr=0.05, **kw)
    )
    assert_params(a, b, start, rtol=0, atol=0)


def test_fused_sgd_weight_decay_after_momentum_and_errors() -> None:
    model = nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = FusedSGD(
        model.parameters(), lr=0.1, momentum=0.5, weight_decay=0.1, wd_after_momentum=True
    )
    for _ in range(2):
        model.weight.grad = torch.ones(1, 3)
        opt.step()
    # step 1: b = g = 1, w = 1 - 0.1 (1 + 0.1) = 0.89; step 2: b = 1.5, w = 0.89 - 0.1 (1.5 + 0.089)
    torch.testing.assert_close(model.weight, torch.full((1, 3), 0.89 - 0.1 * (1.5 + 0.089)))
    with pytest.raises(TypeError, match="lr"):
        FusedSGD(model.parameters())
    with pytest.raises(ValueError, match="Nesterov"):
        FusedSGD(model.parameters(), lr=0.1, nesterov=True)


# ---- FusedLAMB -------------------------------------------------------------------------------


def apex_lamb_step(
    x: Tensor,
    g: Tensor,
    m: Tensor,
    v: Tensor,
    t: int,
    clip: float,
    *,
    lr: float,
    wd: float,
    adam_w: bool,
    averaging: bool,
    nvlamb: bool,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-6,
) -> Tensor:
    """apex's multi_tensor_lamb kernel, element formula by formula (updates m, v in place)."""
    b1, b2 = betas
    sg = g / clip
    if not adam_w:
        sg = sg + wd * x
    m.copy_(m * b1 + (1 - b1 if averaging else 1.0) * sg)
    v.copy_(v * b2 + (1 - b2) * sg * sg)
    u = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps)
    if adam_w:
        u = u + wd * x
    ratio = lr
    if nvlamb or wd != 0:
        pn, un = x.norm(), u.norm()
        ratio = lr * (pn / un).item() if pn > 0 and un > 0 else lr
    return x - ratio * u


@pytest.mark.parametrize(
    "kw",
    [
        {"weight_decay": 0.1},
        {"weight_decay": 0.0},
        {"weight_decay": 0.0, "use_nvlamb": True},
        {"weight_decay": 0.05, "adam_w_mode": False, "grad_averaging": False, "max_grad_norm": 0.1},
    ],
)
def test_fused_lamb_follows_apex_kernel(kw: dict[str, float]) -> None:
    model = make_model()
    start = copy.deepcopy(model)
    ref = [p.detach().clone() for p in model.parameters()]
    states = [(torch.zeros_like(p), torch.zeros_like(p)) for p in ref]
    opt = FusedLAMB(model.parameters(), lr=1e-2, **kw)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(3)
    for t in range(1, 5):
        x = torch.randn(5, 6, generator=gen)
        opt.zero_grad()
        model(x).pow(2).mean().mul(10).backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]
        total = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
        max_norm = kw.get("max_grad_norm", 1.0)
        clip = (total / max_norm).item() if total > max_norm else 1.0
        opt.step()
        ref = [
            apex_lamb_step(
                x0,
                g,
                m,
                v,
                t,
                clip,
                lr=1e-2,
                wd=kw["weight_decay"],
                adam_w=bool(kw.get("adam_w_mode", True)),
                averaging=bool(kw.get("grad_averaging", True)),
                nvlamb=bool(kw.get("use_nvlamb", False)),
            )
            for x0, g, (m, v) in zip(ref, grads, states, strict=True)
        ]
    for p, r in zip(model.parameters(), ref, strict=True):
        torch.testing.assert_close(p.detach(), r, rtol=1e-5, atol=1e-7)
    assert opt.param_groups[0]["step"] == 4
    assert (
        max(
            (p - q).abs().max().item()
            for p, q in zip(model.parameters(), start.parameters(), strict=True)
        )
        > 1e-3
    )


def test_fused_lamb_equals_lamb_where_they_agree() -> None:
    """Decoupled decay, no clipping, weight norms below Lamb's clamp of 10."""
    a, b, start = run_pair(
        lambda p: FusedLAMB(p, lr=1e-2, weight_decay=0.1, max_grad_norm=float("inf")),
        lambda p: Lamb(p, lr=1e-2, weight_decay=0.1),
    )
    assert_params(a, b, start)


def test_fused_lamb_state_dict_round_trip_and_errors() -> None:
    model = make_model()
    opt = FusedLAMB(model.parameters(), lr=1e-2)
    train(model, opt, steps=2)
    twin = copy.deepcopy(model)
    opt2 = FusedLAMB(twin.parameters(), lr=1e-2)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    train(model, opt, steps=2)
    train(twin, opt2, steps=2)
    assert_params(model, twin, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedLAMB(model.parameters(), amsgrad=True)
    with pytest.raises(ValueError, match="max_grad_norm"):
        FusedLAMB(model.parameters(), max_grad_norm=0.0)


# ---- unsharded distributed optimizers ---------------------------------------------------------


def test_distributed_lamb_unsharded_is_lamb() -> None:
    a, b, start = run_pair(
        lambda p: DistributedLamb(p, lr=1e-2, weight_decay=0.1),
        lambda p: Lamb(p, lr=1e-2, weight_decay=0.1),
    )
    assert_params(a, b, start, rtol=1e-5, atol=1e-6)  # its norms are sqrt(sum(x^2))


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"beta1": 0.9, "weight_decay": 0.1},
        {"warmup_init": True},
        {"lr": 1e-2, "relative_step": False, "scale_parameter": False, "clip_threshold": 0.5},
    ],
)
def test_distributed_adafactor_unsharded_is_hf_adafactor(kw: dict[str, float]) -> None:
    """In fp64, to see the identity: Adafactor's first step is ``g / sqrt(g² + ε₁)`` = sign(g)
    for 1D parameters, so in fp32 rounding-level differences of near-zero gradients at later
    steps become differences of ~1e-6 in the parameters."""
    transformers = pytest.importorskip("transformers.optimization")
    a, b, start = run_pair(
        lambda p: DistributedAdaFactor(p, **kw),  # type: ignore[arg-type]
        lambda p: transformers.Adafactor(p, **kw),
        torch.float64,
    )
    assert_params(a, b, None, rtol=1e-12, atol=1e-14)
    if "warmup_init" not in kw:  # the warm-up moves parameters by ~1e-6 per step
        assert_params(a, a, start)


def test_distributed_adafactor_argument_errors() -> None:
    params = list(nn.Linear(2, 2).parameters())
    with pytest.raises(ValueError, match="relative_step=False to use lr"):
        DistributedAdaFactor(params, lr=1e-3)
    with pytest.raises(ValueError, match="needs lr"):
        DistributedAdaFactor(params, relative_step=False)
    with pytest.raises(ValueError, match="warmup_init"):
        DistributedAdaFactor(params, lr=1e-3, relative_step=False, warmup_init=True)
