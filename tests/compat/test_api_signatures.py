"""Pins the public signatures and import paths the Colossal-AI docs use (CHECKLIST §2, §5).

Each pin lists the parameters in order as ``name`` (required), ``name=<repr of default>``,
``*name`` (keyword-only), ``*args`` / ``**kwargs``. Where kolossos deliberately differs from the
upstream signature the comment next to the pin says how and why; any other change here breaks
scripts written against the docs (positional calls included), so update the pin only on purpose.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import pytest
from pin_notation import P, describe

import kolossos
from kolossos.booster import Booster
from kolossos.booster.plugin import Plugin, TorchDDPPlugin
from kolossos.cluster import DistCoordinator
from kolossos.interface import OptimizerWrapper
from kolossos.mixed_precision import FP16NaiveMixedPrecision, FP16TorchMixedPrecision
from kolossos.testing import spawn

PREPARE_DATALOADER = (
    "dataset batch_size shuffle=False seed=1024 drop_last=False pin_memory=False num_workers=0 "
    "**kwargs"
)


PINS: dict[str, tuple[Callable[..., Any], list[str]]] = {
    # backend: None (nccl with CUDA, gloo without) instead of 'nccl', so the docs' scripts run on a
    # CPU; timeout is a kolossos addition, appended so positional calls keep their meaning.
    "launch": (
        kolossos.launch,
        P(
            "config rank world_size host port backend=None local_rank=None seed=1024 "
            "verbose=True timeout=None"
        ),
    ),
    # config=None: the docs always pass config=dict(); optional here (upstream: required).
    "launch_from_torch": (
        kolossos.launch_from_torch,
        P("config=None backend=None seed=1024 verbose=True timeout=None"),
    ),
    "launch_from_slurm": (
        kolossos.launch_from_slurm,
        P("config host port backend=None seed=1024 verbose=True timeout=None"),
    ),
    "launch_from_openmpi": (
        kolossos.launch_from_openmpi,
        P("config host port backend=None seed=1024 verbose=True timeout=None"),
    ),
    "get_default_parser": (kolossos.get_default_parser, P("")),
    # device=None: the accelerator's device (upstream default 'cuda').
    "Booster.__init__": (Booster.__init__, P("device=None mixed_precision=None plugin=None")),
    "Booster.boost": (
        Booster.boost,
        P("model optimizer=None criterion=None dataloader=None lr_scheduler=None"),
    ),
    "Booster.backward": (Booster.backward, P("loss optimizer")),
    "Booster.no_sync": (Booster.no_sync, P("model=None optimizer=None")),
    "Booster.execute_pipeline": (
        Booster.execute_pipeline,
        P("data_iter model criterion optimizer=None return_loss=True return_outputs=False"),
    ),
    # use_async=False: appended (Colossal-AI's later releases have the same keyword).
    "Booster.save_model": (
        Booster.save_model,
        P(
            "model checkpoint shard=False gather_dtensor=True prefix=None size_per_shard=1024 "
            "use_safetensors=False use_async=False"
        ),
    ),
    "Booster.load_model": (Booster.load_model, P("model checkpoint strict=True")),
    "Booster.save_optimizer": (
        Booster.save_optimizer,
        P(
            "optimizer checkpoint shard=False gather_dtensor=True prefix=None size_per_shard=1024 "
            "use_async=False"
        ),
    ),
    "Booster.load_optimizer": (Booster.load_optimizer, P("optimizer checkpoint")),
    "Booster.save_lr_scheduler": (Booster.save_lr_scheduler, P("lr_scheduler checkpoint")),
    "Booster.load_lr_scheduler": (Booster.load_lr_scheduler, P("lr_scheduler checkpoint")),
    "TorchDDPPlugin.__init__": (
        TorchDDPPlugin.__init__,
        P(
            "broadcast_buffers=True bucket_cap_mb=25 find_unused_parameters=False "
            "check_reduction=False gradient_as_bucket_view=False static_graph=False"
        ),
    ),
    "Plugin.prepare_dataloader": (Plugin.prepare_dataloader, P(PREPARE_DATALOADER)),
    "TorchDDPPlugin.prepare_dataloader": (
        TorchDDPPlugin.prepare_dataloader,
        P(PREPARE_DATALOADER),
    ),
    # enabled is a kolossos addition (appended).
    "FP16TorchMixedPrecision.__init__": (
        FP16TorchMixedPrecision.__init__,
        P(
            "init_scale=65536.0 growth_factor=2.0 backoff_factor=0.5 growth_interval=2000 "
            "enabled=True"
        ),
    ),
    # Upstream: (log_num_zeros_in_grad, initial_scale, growth_factor, backoff_factor, hysteresis,
    # max_scale, verbose=None), all but verbose required. kolossos gives every parameter a
    # default and keeps upstream's positional order (verbose seventh); min_scale and
    # growth_interval (named by the legacy naive-AMP docs), keep_batchnorm_fp32 and master_weights
    # follow as keyword-only additions.
    "FP16NaiveMixedPrecision.__init__": (
        FP16NaiveMixedPrecision.__init__,
        P(
            "log_num_zeros_in_grad=False initial_scale=4294967296 growth_factor=2 "
            "backoff_factor=0.5 hysteresis=2 max_scale=4294967296 verbose=False *min_scale=1 "
            "*growth_interval=1000 *keep_batchnorm_fp32=False *master_weights=True"
        ),
    ),
    "OptimizerWrapper.clip_grad_by_norm": (
        OptimizerWrapper.clip_grad_by_norm,
        P("max_norm norm_type=2.0 error_if_nonfinite=False"),
    ),
    "OptimizerWrapper.clip_grad_by_value": (
        OptimizerWrapper.clip_grad_by_value,
        P("clip_value *args **kwargs"),
    ),
    # Upstream: spawn(func, nprocs=1, **kwargs); the docs call spawn(run, world_size)
    # positionally. kolossos names them fn/world_size and adds keyword-only limits.
    "spawn": (spawn, P("fn world_size=1 *timeout=None *start_method=None **kwargs")),
    "DistCoordinator.__init__": (DistCoordinator.__init__, P("")),
    "DistCoordinator.is_master": (DistCoordinator.is_master, P("pg=None")),
    "DistCoordinator.is_node_master": (DistCoordinator.is_node_master, P("")),
    "DistCoordinator.is_last_process": (DistCoordinator.is_last_process, P("pg=None")),
    "DistCoordinator.print_on_master": (DistCoordinator.print_on_master, P("msg")),
    "DistCoordinator.print_on_node_master": (DistCoordinator.print_on_node_master, P("msg")),
    "DistCoordinator.priority_execution": (
        DistCoordinator.priority_execution,
        P("executor_rank=0 pg=None"),
    ),
    "DistCoordinator.destroy": (DistCoordinator.destroy, P("pg=None")),
    "DistCoordinator.block_all": (DistCoordinator.block_all, P("pg=None")),
    "DistCoordinator.on_master_only": (DistCoordinator.on_master_only, P("pg=None")),
}


@pytest.mark.parametrize("name", sorted(PINS))
def test_signature_is_pinned(name: str) -> None:
    fn, expected = PINS[name]
    assert describe(fn) == expected


def test_module_level_priority_execution_matches_the_method() -> None:
    from kolossos.cluster.dist_coordinator import priority_execution

    assert describe(priority_execution) == ["executor_rank=0", "pg=None"]


def test_dist_coordinator_attributes_without_a_process_group() -> None:
    coordinator = DistCoordinator()
    assert (coordinator.rank, coordinator.world_size) == (0, 1)
    assert isinstance(coordinator.local_rank, int)
    assert coordinator.is_master() and coordinator.is_node_master()
    assert coordinator.is_last_process()


PARSER_ARGS = [
    # (option, default, type). Upstream: --host and --port have no default, --backend 'nccl';
    # kolossos: 127.0.0.1 / 29500 / None (nccl with CUDA, gloo without).
    ("--config", None, str),
    ("--host", "127.0.0.1", str),
    ("--port", 29500, int),
    ("--world_size", None, int),
    ("--rank", None, int),
    ("--local_rank", None, int),
    ("--backend", None, str),
]


def test_default_parser_arguments() -> None:
    parser = kolossos.get_default_parser()
    actions = [a for a in parser._actions if a.dest != "help"]
    got = [(a.option_strings[0], a.default, a.type) for a in actions]
    assert got == PARSER_ARGS
    command_line = "--config cfg.py --host node1 --port 29501 --world_size 8 --rank 3 "
    args = parser.parse_args((command_line + "--local_rank 3 --backend gloo").split())
    assert (args.config, args.host, args.port, args.world_size) == ("cfg.py", "node1", 29501, 8)
    assert (args.rank, args.local_rank, args.backend) == (3, 3, "gloo")
    parser.add_argument("--steps", type=int, default=1)  # the docs add their own arguments
    assert parser.parse_args(["--steps", "4"]).steps == 4


DOC_IMPORTS = [
    "kolossos.Booster",
    "kolossos.launch",
    "kolossos.launch_from_torch",
    "kolossos.launch_from_slurm",
    "kolossos.launch_from_openmpi",
    "kolossos.get_default_parser",
    "kolossos.booster.Booster",
    "kolossos.booster.plugin.TorchDDPPlugin",
    "kolossos.mixed_precision.FP16TorchMixedPrecision",
    "kolossos.booster.mixed_precision.FP16TorchMixedPrecision",
    "kolossos.booster.mixed_precision.FP16ApexMixedPrecision",
    "kolossos.booster.mixed_precision.FP16NaiveMixedPrecision",
    "kolossos.cluster.DistCoordinator",
    "kolossos.cluster.dist_coordinator.priority_execution",
    "kolossos.logging.get_dist_logger",
    "kolossos.utils.get_current_device",
    "kolossos.utils.print_rank_0",
    "kolossos.testing.spawn",
]


def resolve(dotted: str) -> Any:
    """Import ``module.name`` the way ``from module import name`` does."""
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("dotted", DOC_IMPORTS)
def test_doc_import_path_resolves(dotted: str) -> None:
    assert callable(resolve(dotted))


@pytest.mark.parametrize(
    ("alias", "original"),
    [
        ("kolossos.Booster", "kolossos.booster.Booster"),
        (
            "kolossos.mixed_precision.FP16TorchMixedPrecision",
            "kolossos.booster.mixed_precision.FP16TorchMixedPrecision",
        ),
        (
            "kolossos.mixed_precision.FP16NaiveMixedPrecision",
            "kolossos.booster.mixed_precision.FP16NaiveMixedPrecision",
        ),
    ],
)
def test_import_aliases_are_the_same_object(alias: str, original: str) -> None:
    assert resolve(alias) is resolve(original)
