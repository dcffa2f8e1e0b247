"""``ParallelContext``: Colossal-AI's global parallel context (``gpc``) over torch process
groups.

``kolossos.launch(config=...)`` fills it (see :mod:`kolossos.legacy.launch_hook`): the config is
loaded and checked before the rendezvous, and after it every rank creates the groups the
``parallel`` key describes, in one order, with ``torch.distributed.new_group``.
"""

from __future__ import annotations

import socket
from collections import Counter
from collections.abc import Hashable, Mapping
from os import PathLike
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup

from kolossos.initialize import get_launch_config
from kolossos.legacy.constants import INITIALIZER_MAPPING
from kolossos.legacy.context.config import Config
from kolossos.legacy.context.parallel_mode import ParallelMode
from kolossos.legacy.context.parallel_rules import ParallelLayout, parse_parallel
from kolossos.legacy.context.process_group_initializer import GroupSetting
from kolossos.legacy.context.random import add_seed, set_mode
from kolossos.legacy.context.reserved_keys import check_config_keys
from kolossos.legacy.global_variables import tensor_parallel_env as env
from kolossos.legacy.registry import DIST_GROUP_INITIALIZER
from kolossos.moe import MOE_CONTEXT

__all__ = ["ParallelContext", "global_context"]


class ParallelContext:
    """Ranks, sizes and process groups of every parallel mode, plus the launch config.

    Use the process-wide instance, ``from kolossos.legacy.core import global_context as gpc``.

    Example:
        >>> gpc.get_world_size(ParallelMode.DATA)  # doctest: +SKIP
        2
    """

    def __init__(self) -> None:
        self._config: Config | None = None
        self._layout: ParallelLayout | None = None
        self._reset_groups()
        self.num_processes_on_current_node = -1
        self.virtual_pipeline_parallel_size: int | None = None
        self.virtual_pipeline_parallel_rank: int | None = None
        self.verbose = False

    def _reset_groups(self) -> None:
        self._global_ranks: dict[Hashable, int] = {}
        self._local_ranks: dict[Hashable, int] = {}
        self._world_sizes: dict[Hashable, int] = {}
        self._groups: dict[Hashable, ProcessGroup] = {}
        self._cpu_groups: dict[Hashable, ProcessGroup | None] = {}
        self._ranks_in_group: dict[Hashable, list[int]] = {}
        self.world_size = 1
        self.data_parallel_size = 1
        self.pipeline_parallel_size = 1
        self.tensor_parallel_size = 1

    # ------------------------------------------------------------------ config
    @property
    def config(self) -> Config:
        """The launch config (an empty ``Config`` before launch)."""
        if self._config is None:
            self._config = Config()
        return self._config

    def load_config(self, config: Mapping[str, Any] | str | PathLike[str]) -> None:
        """Load a config dict or file and check its keys (one warning per unknown key).

        Raises:
            TypeError: ``config`` is neither a dict nor a path, or a reserved key has the
                wrong type.
            FileNotFoundError / ValueError / ConfigException: see :meth:`Config.from_file`.
        """
        if isinstance(config, (str, PathLike)):
            loaded = Config.from_file(config)
        elif isinstance(config, Mapping):
            loaded = Config(config)
        else:
            raise TypeError(
                f"config must be a dict or the path of a config file, got {type(config).__name__}."
            )
        check_config_keys(loaded)
        self._config = loaded

    def check_parallel(self, world_size: int) -> ParallelLayout:
        """Check the ``parallel`` key against ``world_size`` (no process group needed).

        Raises:
            ValueError / NotImplementedError: see :func:`parse_parallel`.
        """
        self._layout = parse_parallel(self.config.get("parallel"), world_size)
        return self._layout

    # ------------------------------------------------------------------ lookups
    def _lookup(self, table: Mapping[Hashable, Any], mode: Hashable) -> Any:
        if not isinstance(mode, Hashable) or isinstance(mode, (int, float)):
            raise TypeError(f"parallel_mode must be a ParallelMode, got {mode!r}.")
        self._adopt_launch()
        if mode not in table:
            known = ", ".join(str(m) for m in self._groups) or "none (not launched)"
            raise KeyError(
                f"{mode} is not initialised (initialised: {known}); add it to the parallel "
                "config given to kolossos.launch."
            )
        return table[mode]

    def _adopt_launch(self) -> None:
        """After a launch that did not go through the hook (``kolossos.initialize.launch``
        imported directly with a config without ``parallel``), know the global group at least."""
        if ParallelMode.GLOBAL in self._groups or not dist.is_initialized():
            return
        from_launch = get_launch_config()
        if from_launch is not None and self._config is None:
            self.load_config(from_launch)
        if self.config.get("parallel") is not None:
            raise RuntimeError(
                "the launch config has a 'parallel' key but the global context holds no groups; "
                "launch with kolossos.launch*(config=...) (not kolossos.initialize.launch), or "
                "call gpc.init_parallel_groups() on every rank."
            )
        self.init_global_groups()

    def get_global_rank(self) -> int:
        """This process's rank in the world."""
        return int(self._lookup(self._global_ranks, ParallelMode.GLOBAL))

    def add_global_rank(self, parallel_mode: Hashable, rank: int) -> None:
        """Record this process's global rank for ``parallel_mode``."""
        self._global_ranks[parallel_mode] = rank

    def get_local_rank(self, parallel_mode: Hashable) -> int:
        """This process's rank inside its ``parallel_mode`` group."""
        return int(self._lookup(self._local_ranks, parallel_mode))

    def get_world_size(self, parallel_mode: Hashable) -> int:
        """The size of this process's ``parallel_mode`` group."""
        return int(self._lookup(self._world_sizes, parallel_mode))

    def get_group(self, parallel_mode: Hashable) -> ProcessGroup:
        """This process's ``parallel_mode`` group."""
        group: ProcessGroup = self._lookup(self._groups, parallel_mode)
        return group

    def get_cpu_group(self, parallel_mode: Hashable) -> ProcessGroup | None:
        """The gloo twin of :meth:`get_group` (the group itself under gloo)."""
        group: ProcessGroup | None = self._lookup(self._cpu_groups, parallel_mode)
        return group

    def get_ranks_in_group(self, parallel_mode: Hashable) -> list[int]:
        """The global ranks of this process's ``parallel_mode`` group, in group-rank order."""
        return list(self._lookup(self._ranks_in_group, parallel_mode))

    def get_next_global_rank(self, parallel_mode: Hashable) -> int:
        """The global rank after this one in its group (wrapping around)."""
        ranks = self.get_ranks_in_group(parallel_mode)
        return ranks[(self.get_local_rank(parallel_mode) + 1) % len(ranks)]

    def get_prev_global_rank(self, parallel_mode: Hashable) -> int:
        """The global rank before this one in its group (wrapping around)."""
        ranks = self.get_ranks_in_group(parallel_mode)
        return ranks[(self.get_local_rank(parallel_mode) - 1) % len(ranks)]

    def is_first_rank(self, parallel_mode: Hashable) -> bool:
        """Whether this process is rank 0 of its ``parallel_mode`` group."""
        return self.get_local_rank(parallel_mode) == 0

    def is_last_rank(self, parallel_mode: Hashable) -> bool:
        """Whether this process is the last rank of its ``parallel_mode`` group."""
        return self.get_local_rank(parallel_mode) == self.get_world_size(parallel_mode) - 1

    def is_pipeline_first_stage(self, ignore_virtual: bool = False) -> bool:
        """First pipeline stage (and first virtual chunk unless ``ignore_virtual``); True
        without pipeline parallelism."""
        virtual = self.virtual_pipeline_parallel_size is not None
        if not ignore_virtual and virtual and self.virtual_pipeline_parallel_rank != 0:
            return False
        return not self.is_initialized(ParallelMode.PIPELINE) or self.is_first_rank(
            ParallelMode.PIPELINE
        )

    def is_pipeline_last_stage(self, ignore_virtual: bool = False) -> bool:
        """Last pipeline stage (and last virtual chunk unless ``ignore_virtual``); True
        without pipeline parallelism."""
        size = self.virtual_pipeline_parallel_size
        last_chunk = size is None or self.virtual_pipeline_parallel_rank == size - 1
        if not ignore_virtual and not last_chunk:
            return False
        return not self.is_initialized(ParallelMode.PIPELINE) or self.is_last_rank(
            ParallelMode.PIPELINE
        )

    def is_initialized(self, parallel_mode: Hashable) -> bool:
        """Whether a group of ``parallel_mode`` exists on this process."""
        self._adopt_launch()
        return parallel_mode in self._groups

    def set_virtual_pipeline_parallel_size(self, size: int | None) -> None:
        """Model chunks per stage of an interleaved pipeline."""
        self.virtual_pipeline_parallel_size = size

    def set_virtual_pipeline_parallel_rank(self, rank: int | None) -> None:
        """The chunk being run now."""
        self.virtual_pipeline_parallel_rank = rank

    # ------------------------------------------------------------------ building groups
    def _register_dist(self, setting: GroupSetting | tuple[Any, ...]) -> None:
        local_rank, world_size, group, cpu_group, ranks, mode = setting
        self._local_ranks[mode] = local_rank
        self._world_sizes[mode] = world_size
        self._groups[mode] = group
        self._cpu_groups[mode] = cpu_group
        self._ranks_in_group[mode] = list(ranks)

    def init_global_groups(self) -> None:
        """Record the world group as ``GLOBAL`` (and ``DATA`` when nothing else is parallel).
        Local: no collective."""
        rank, world = dist.get_rank(), dist.get_world_size()
        world_group = dist.group.WORLD
        assert world_group is not None
        self._register_dist(
            (rank, world, world_group, world_group, list(range(world)), ParallelMode.GLOBAL)
        )
        self.add_global_rank(ParallelMode.GLOBAL, rank)
        self.world_size = self.data_parallel_size = world
        if self.config.get("parallel") is None:
            self._register_dist(
                (rank, world, world_group, world_group, list(range(world)), ParallelMode.DATA)
            )

    def init_parallel_groups(self) -> None:
        """Create the groups of the ``parallel`` config: DATA, MODEL, PIPELINE (if > 1),
        TENSOR, then the tensor mode's own groups, then MOE_MODEL and MOE_DATA.

        COLLECTIVE over the world: every rank must call it, in the same place.

        Raises:
            ValueError / NotImplementedError: a broken ``parallel`` rule (before any group).
            NameError: the mode's initializer is not registered.
        """
        world, rank = dist.get_world_size(), dist.get_rank()
        layout = self._layout if self._layout and self._layout.world_size == world else None
        layout = layout or self.check_parallel(world)
        self._reset_groups()
        self.init_global_groups()
        self.data_parallel_size = layout.data_size
        self.pipeline_parallel_size = layout.pipeline_size
        self.tensor_parallel_size = layout.tensor_size
        env.mode = layout.tensor_mode
        plan: list[tuple[str, dict[str, Any]]] = [("data", {}), ("model", {})]
        if layout.pipeline_size > 1:
            plan.append(("pipeline", {}))
        plan.append(("tensor", {}))
        if layout.tensor_mode is not None:
            plan.append((layout.tensor_mode, dict(layout.tensor_kwargs)))
        if layout.moe_size is not None:
            plan.append(("moe", dict(moe_size=layout.moe_size)))
        else:  # no stale expert groups of an earlier launch
            MOE_CONTEXT.set_parallel_info(None)
        sizes = (layout.data_size, layout.pipeline_size, layout.tensor_size)
        for key, kwargs in plan:
            cls = DIST_GROUP_INITIALIZER.get_module(INITIALIZER_MAPPING[key])
            initializer = cls(rank, world, self.config, *sizes, **kwargs)
            result = initializer.init_dist_group()
            for setting in result if isinstance(result, list) else [result]:
                if setting is not None and setting[0] is not None:
                    self._register_dist(setting)

    def detect_num_processes_on_current_node(self) -> None:
        """Count the processes on this host (COLLECTIVE over the world)."""
        hostname = socket.gethostname()
        names: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(names, hostname)
        self.num_processes_on_current_node = Counter(names)[hostname]

    def set_seed(self, seed: int) -> None:
        """Seed the per-mode streams as Colossal-AI does: ``GLOBAL`` and ``DATA`` get ``seed``
        (the same stream everywhere), ``TENSOR`` gets ``seed + tp_rank + 1024 * pp_rank``; the
        generator is left on the ``DATA`` stream."""
        add_seed(ParallelMode.GLOBAL, seed, overwrite=True)
        add_seed(ParallelMode.DATA, seed, overwrite=True)
        if ParallelMode.TENSOR in self._groups:
            offset = self._local_ranks.get(ParallelMode.PIPELINE, 0) * 1024
            tp_seed = seed + self._local_ranks[ParallelMode.TENSOR] + offset
            add_seed(ParallelMode.TENSOR, tp_seed, overwrite=True)
        set_mode(ParallelMode.DATA)

    def reset(self) -> None:
        """Forget the groups, sizes and config without destroying anything (local)."""
        self._reset_groups()
        self._config = None
        self._layout = None

    def destroy(self) -> None:
        """Destroy every group this context created, then the default (world) group, as
        Colossal-AI does, and forget the config. Call it on every rank."""
        world = dist.group.WORLD
        seen: set[int] = set()
        for group in list(self._groups.values()) + list(self._cpu_groups.values()):
            if group is None or group is world or id(group) in seen:
                continue
            seen.add(id(group))
            if dist.is_initialized():
                dist.destroy_process_group(group)
        if dist.is_initialized():
            dist.destroy_process_group()
        self._reset_groups()
        self._config = None
        self._layout = None
        env.load()


#: the process-wide context (Colossal-AI's ``colossalai.core.global_context``)
global_context = ParallelContext()
