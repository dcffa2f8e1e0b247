"""Pins the signatures and import paths of the Colossal-AI names of issue 19, item 7
(``Accelerator``, ``DeviceMesh``, ``DeviceMeshManager``/``DeviceMeshInfo``,
``HybridParallelCheckpointIO``, ``multi_tensor_applier``, ``FusedLAMB``, ``FusedSGD``,
``DistributedLamb``, ``DistributedAdaFactor``; upstream v0.3.6-v0.3.9), in the notation of
``test_api_signatures.py``: ``name`` (required), ``name=<repr of default>``, ``*name``
(keyword-only), ``*args`` / ``**kwargs``.

Upstream's parameter names, order and defaults are what scripts written against it use; change a
pin only on purpose, with a comment saying how and why it differs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import pytest
from pin_notation import P, describe

import kolossos.utils
from kolossos.booster.accelerator import Accelerator
from kolossos.cluster.device_mesh_manager import DeviceMeshInfo, DeviceMeshManager
from kolossos.device.device_mesh import DeviceMesh
from kolossos.nn.optimizer import DistributedAdaFactor, DistributedLamb, FusedLAMB, FusedSGD
from kolossos.utils.multi_tensor_apply import MultiTensorApply

PINS: dict[str, tuple[Callable[..., Any], list[str]]] = {
    "Accelerator.__init__": (Accelerator.__init__, P("device")),
    "Accelerator.bind": (Accelerator.bind, P("")),
    "Accelerator.configure_model": (Accelerator.configure_model, P("model")),
    # device=None: the accelerator's device (upstream: 'cuda'), so scripts run on a CPU machine.
    "DeviceMesh.__init__": (
        DeviceMesh.__init__,
        P(
            "physical_mesh_id mesh_shape=None logical_mesh_id=None mesh_alpha=None "
            "mesh_beta=None init_process_group=False device=None"
        ),
    ),
    "DeviceMesh.get_process_group": (DeviceMesh.get_process_group, P("axis global_rank=None")),
    "DeviceMesh.get_process_group_for_all_axes": (
        DeviceMesh.get_process_group_for_all_axes,
        P("global_rank=None"),
    ),
    "DeviceMesh.get_ranks_in_process_group": (
        DeviceMesh.get_ranks_in_process_group,
        P("axis global_rank=None"),
    ),
    "DeviceMesh.global_rank_to_local_rank": (
        DeviceMesh.global_rank_to_local_rank,
        P("rank axis=None"),
    ),
    "DeviceMesh.from_process_group": (DeviceMesh.from_process_group, P("process_group")),
    "DeviceMesh.init_logical_process_group": (DeviceMesh.init_logical_process_group, P("")),
    "DeviceMesh.flatten": (DeviceMesh.flatten, P("")),
    "DeviceMesh.all_gather_cost": (DeviceMesh.all_gather_cost, P("num_bytes mesh_dim")),
    "DeviceMesh.all_reduce_cost": (DeviceMesh.all_reduce_cost, P("num_bytes mesh_dim")),
    "DeviceMesh.reduce_scatter_cost": (DeviceMesh.reduce_scatter_cost, P("num_bytes mesh_dim")),
    "DeviceMesh.all_to_all_cost": (DeviceMesh.all_to_all_cost, P("num_bytes mesh_dim")),
    "DeviceMeshInfo": (DeviceMeshInfo, P("physical_ids mesh_shape=None")),
    "DeviceMeshManager.__init__": (DeviceMeshManager.__init__, P("")),
    "DeviceMeshManager.create_device_mesh": (
        DeviceMeshManager.create_device_mesh,
        P("name device_mesh_info"),
    ),
    "DeviceMeshManager.get": (DeviceMeshManager.get, P("name")),
    "DeviceMeshManager.destroy": (DeviceMeshManager.destroy, P("name")),
    "DeviceMeshManager.destroy_all": (DeviceMeshManager.destroy_all, P("")),
    "MultiTensorApply.__init__": (MultiTensorApply.__init__, P("chunk_size")),
    "MultiTensorApply.__call__": (
        MultiTensorApply.__call__,
        P("op noop_flag_buffer tensor_lists *args"),
    ),
    "FusedLAMB.__init__": (
        FusedLAMB.__init__,
        P(
            "params lr=0.001 bias_correction=True betas=(0.9,|0.999) eps=1e-06 "
            "weight_decay=0.01 amsgrad=False adam_w_mode=True grad_averaging=True "
            "set_grad_none=True max_grad_norm=1.0 use_nvlamb=False"
        ),
    ),
    # set_to_none: torch's zero_grad argument (upstream's FusedLAMB.zero_grad takes none).
    "FusedLAMB.zero_grad": (FusedLAMB.zero_grad, P("set_to_none=None")),
    "FusedSGD.__init__": (
        FusedSGD.__init__,
        P(
            "params lr=<required|parameter> momentum=0 dampening=0 weight_decay=0 "
            "nesterov=False wd_after_momentum=False"
        ),
    ),
    "DistributedLamb.__init__": (
        DistributedLamb.__init__,
        P("params lr=0.001 betas=(0.9,|0.999) eps=1e-06 weight_decay=0 bias_correction=True"),
    ),
    # shard_to_working_param=None (upstream: a shared mutable {}); None means an empty mapping.
    "DistributedLamb.setup_distributed": (
        DistributedLamb.setup_distributed,
        P("tp_group=None dp_group=None shard_to_working_param=None padding_map=None is_zero=False"),
    ),
    "DistributedAdaFactor.__init__": (
        DistributedAdaFactor.__init__,
        P(
            "params lr=None eps=(1e-30,|0.001) clip_threshold=1.0 decay_rate=-0.8 beta1=None "
            "weight_decay=0.0 scale_parameter=True relative_step=True warmup_init=False"
        ),
    ),
    # shard_to_working_param=None as DistributedLamb's; use_zero (not is_zero) as upstream.
    "DistributedAdaFactor.setup_distributed": (
        DistributedAdaFactor.setup_distributed,
        P("tp_group=None dp_group=None shard_to_working_param=None padding_map=None use_zero=True"),
    ),
}


@pytest.mark.parametrize("name", sorted(PINS))
def test_signature_is_pinned(name: str) -> None:
    fn, expected = PINS[name]
    assert describe(fn) == expected


IMPORTS = {
    "kolossos.booster.accelerator": "Accelerator",
    "kolossos.device.device_mesh": "DeviceMesh",
    "kolossos.cluster": "DeviceMeshManager DistCoordinator ProcessGroupMesh",
    "kolossos.cluster.device_mesh_manager": "DeviceMeshInfo DeviceMeshManager",
    "kolossos.checkpoint_io": "HybridParallelCheckpointIO GeneralCheckpointIO CheckpointIO",
    "kolossos.utils.multi_tensor_apply": "MultiTensorApply multi_tensor_applier",
    "kolossos.nn.optimizer": (
        "FusedLAMB FusedSGD DistributedLamb DistributedAdaFactor FusedAdam Lamb Lars CPUAdam "
        "HybridAdam"
    ),
    "kolossos.nn.optimizer.fused_lamb": "FusedLAMB",
    "kolossos.nn.optimizer.fused_sgd": "FusedSGD",
    "kolossos.nn.optimizer.distributed_lamb": "DistributedLamb",
    "kolossos.nn.optimizer.distributed_adafactor": "DistributedAdaFactor",
}


@pytest.mark.parametrize("module", sorted(IMPORTS))
def test_upstream_import_paths(module: str) -> None:
    imported = importlib.import_module(module)
    for name in IMPORTS[module].split():
        assert hasattr(imported, name), f"{module}.{name}"


@pytest.mark.xfail(
    not hasattr(kolossos.utils, "multi_tensor_applier"),
    reason="kolossos.utils re-exports multi_tensor_applier once its __init__ names it",
    strict=True,
)
def test_utils_multi_tensor_applier_is_the_shared_applier() -> None:
    from kolossos.utils.multi_tensor_apply import multi_tensor_applier

    assert kolossos.utils.multi_tensor_applier is multi_tensor_applier
