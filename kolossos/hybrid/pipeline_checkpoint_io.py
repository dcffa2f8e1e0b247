"""``PipelineCheckpointIO``: checkpoints of a pipelined HybridParallelPlugin model
(``pp_size > 1``), the same files as every other plugin's.

Each stage holds some layers. Every stage gathers the full tensors (and optimizer states) of the
layers it holds exactly as :class:`HybridParallelCheckpointIO` does (ZeRO gather over DP, then
TP gather), then:

* sharded model checkpoints (``shard=True``): the stage's first rank (DP 0, TP 0) writes the
  shard files of its own layers into the writer's staging directory; the writer numbers all of
  them in stage order and writes ``config.json`` and the single index (Hugging Face's layout);
* single files and optimizer checkpoints: the stage's first rank streams its items to the writer
  over the pipeline group, stage after stage, one tensor in flight (``_funnel``).

A parameter tied across stages (GPT-2's ``lm_head`` on the last stage, ``wte`` on the first) is
saved once, under the name one process uses. Loading reads the whole model's layout (names and
full shapes recorded at ``boost``); each stage keeps the names it holds (a tied copy takes its
partner's entry) and matches the optimizer checkpoint against its own parameters only. So a
checkpoint moves between any pp / tp / dp sizes, other plugins and one process.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from kolossos.checkpoint_io._common import check_save_args
from kolossos.checkpoint_io.atomic import atomic_directory, fsync_dir, write_text_atomic
from kolossos.checkpoint_io.backends import (
    SAFETENSORS,
    TORCH,
    require_safetensors,
    write_tensor_file,
)
from kolossos.checkpoint_io.errors import CheckpointError, LoadReport
from kolossos.checkpoint_io.index import (
    CONFIG_NAME,
    CheckpointIndex,
    iter_shards,
    nbytes,
    shard_file_name,
)
from kolossos.checkpoint_io.model_files import model_file_names, owned_model_files
from kolossos.checkpoint_io.model_io import hf_config_json
from kolossos.checkpoint_io.optim_files import find_optimizer_checkpoint
from kolossos.checkpoint_io.optim_format import match_optimizer
from kolossos.checkpoint_io.read_plan import ReadPlan, Selector
from kolossos.checkpoint_io.state_check import ModelLayout, finish_report
from kolossos.hybrid.checkpoint_io import HybridParallelCheckpointIO, _gather, _require_gather
from kolossos.hybrid.pipeline_runtime import PipelineRuntime
from kolossos.hybrid.stage_transport import receive_items, send_item
from kolossos.interface import ParamOwners, unwrap_model
from kolossos.nn.layer.parallel_1d.sharding import get_tp_spec
from kolossos.pipeline.shared import is_pp_duplicate

__all__ = ["PipelineCheckpointIO"]

Tree = dict[str, Any]  # one item's values: {"": tensor} for a model entry, a state dict otherwise


class PipelineCheckpointIO(HybridParallelCheckpointIO):
    """Checkpoint IO of :class:`~kolossos.booster.plugin.HybridParallelPlugin` with
    ``pp_size > 1`` (module doc).

    Args:
        dp_group: the data-parallel group.
        tp_group: the tensor-parallel group.
        owners: the optimizer managing each parameter's master copy (the engine's registry).
        pipeline: the engine's :class:`~kolossos.hybrid.pipeline_runtime.PipelineRuntime`.
    """

    def __init__(
        self,
        dp_group: dist.ProcessGroup | None,
        tp_group: dist.ProcessGroup | None,
        owners: ParamOwners,
        pipeline: PipelineRuntime,
    ) -> None:
        super().__init__(dp_group, tp_group, owners)
        self.pipeline = pipeline

    # ------------------------------------------------------------------ model
    def model_state_items(
        self, model: nn.Module, gather_dtensor: bool
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every stage's full tensors on the writer, stage by stage (a collective)."""
        _require_gather(gather_dtensor)
        for name, tree in self._funnel(self._stage_model_items(model)):
            yield name, tree[""]

    def _stage_model_items(self, model: nn.Module) -> Iterator[tuple[str, Tree]]:
        """This stage's full tensors (on its DP 0 / TP 0 rank; a collective of the stage).
        Skipped: tied names, tied copies another stage saves, and entries (replicated buffers)
        a lower pipeline position also holds."""
        aliases = self.pipeline.full_layout.aliases
        entries: dict[str, torch.Tensor] = {}
        for chunk in unwrap_model(model).children():
            for name, value in chunk.state_dict(keep_vars=True).items():
                if name not in aliases and not is_pp_duplicate(value):
                    entries.setdefault(name, value)
        stage = self.pipeline.stage_manager.stage
        lower = {n for names in self._all_stages(list(entries))[:stage] for n in names}
        for name, value in entries.items():
            if name in lower:
                continue
            local = self._local_value(value)
            spec = get_tp_spec(value)
            if local is not None and spec is not None:
                local = _gather(local, spec)
            if local is not None and self._tp_rank() == 0:
                yield name, {"": local}

    def model_layout(self, model: nn.Module) -> ModelLayout:
        """The whole model's names and full shapes (every stage's, + tied names)."""
        layout: ModelLayout = self.pipeline.full_layout
        return layout

    def _local_entries(self, model: nn.Module) -> list[tuple[str, torch.Tensor]]:
        return [
            (n, t)
            for chunk in unwrap_model(model).children()
            for n, t in chunk.state_dict(keep_vars=True).items()
        ]

    def model_read_plan(self, model: nn.Module) -> ReadPlan:
        """Read this stage's entries only (their tensor-parallel slices); skip the others."""
        aliases = self.pipeline.full_layout.aliases
        local = self._local_entries(model)
        canonical = {aliases.get(n, n) for n, _ in local}
        needed = {n for n in self.pipeline.full_layout.shapes if aliases.get(n, n) in canonical}
        plan: dict[str, Selector | None] = {
            n: None for n in self.pipeline.full_layout.shapes if n not in needed
        }
        for name, selector in self._tp_selectors(local).items():
            for stored in needed:
                if aliases.get(stored, stored) == aliases.get(name, name):
                    plan[stored] = selector
        return plan

    def load_model_piece(self, model: nn.Module, piece: dict[str, torch.Tensor]) -> None:
        """Load the entries this stage holds (a tied copy under its partner's name)."""
        aliases = self.pipeline.full_layout.aliases
        local = self._local_entries(model)
        pairs = [(aliases.get(n, n), t) for n, t in local if aliases.get(n, n) in piece]
        self._load_pairs(pairs, piece, None)

    # ------------------------------------------------------------------ optimizer
    def optimizer_param_shapes(
        self, optimizer: Any, names: list[list[str]]
    ) -> dict[str, tuple[int, ...]]:
        """Every stage's parameters' full shapes (a collective of the pipeline)."""
        merged: dict[str, tuple[int, ...]] = {}
        for shapes in self._all_stages(super().optimizer_param_shapes(optimizer, names)):
            merged.update(shapes)
        return merged

    def optimizer_param_groups(
        self, optimizer: Any, names: list[list[str]]
    ) -> list[dict[str, Any]]:
        """Each group's hyper-parameters with every stage's parameter names, stage by stage (a
        tied parameter once; a collective of the pipeline)."""
        groups = super().optimizer_param_groups(optimizer, names)
        merged = [dict(g, params=[]) for g in groups]
        for stage_groups in self._all_stages(groups):  # SYNC POINT: the pipeline group
            for entry, theirs in zip(merged, stage_groups, strict=True):
                entry["params"] += [n for n in theirs["params"] if n not in entry["params"]]
        return merged

    def _all_stages(self, obj: Any) -> list[Any]:
        """``obj`` of every pipeline stage, in stage order (a collective of the pipeline)."""
        group = self.pipeline.stage_manager.group
        out: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out

    def optimizer_state_items(
        self, optimizer: Any, names: list[list[str]], gather_dtensor: bool
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """Every stage's full states on the writer, stage by stage (a collective)."""
        _require_gather(gather_dtensor)
        yield from self._funnel(self._stage_state_items(optimizer, names))

    def save_model(
        self,
        model: nn.Module,
        checkpoint: str | os.PathLike[str],
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: float = 1024,
        use_safetensors: bool = False,
        use_async: bool = False,
    ) -> None:
        """Like the base class; with ``shard=True`` each stage's DP 0 / TP 0 rank writes the
        shard files of its own layers into the writer's staging directory, and the writer
        numbers all of them and writes the one index (Hugging Face's layout). ``use_async``
        saves go through the writer like one-file saves (the same layout; every stage's tensors
        are copied to the writer's host memory, then written in the background)."""
        if not shard or use_async:  # the writer receives every stage's tensors (_funnel)
            return super().save_model(model, checkpoint, shard, gather_dtensor, prefix,
                                      size_per_shard, use_safetensors, use_async)  # fmt: skip
        _require_gather(gather_dtensor)
        max_bytes = check_save_args(checkpoint, size_per_shard, prefix)
        if use_safetensors:
            require_safetensors()
        path = Path(checkpoint)
        if path.is_file():
            raise NotADirectoryError(
                f"checkpoint={str(path)!r} is a file but shard=True writes a directory; pass a "
                "directory path or use shard=False."
            )
        fmt = SAFETENSORS if use_safetensors else TORCH
        names = model_file_names(prefix, use_safetensors)
        config = hf_config_json(model) if not prefix else None

        def write() -> None:
            self._write_stages(model, path, prefix, names, max_bytes, fmt, config)

        self.run_collective_write(write, path)

    def _write_stages(
        self,
        model: nn.Module,
        path: Path,
        prefix: str | None,
        names: tuple[str, str],
        max_bytes: int,
        fmt: str,
        config: str | None,
    ) -> None:
        sm = self.pipeline.stage_manager
        group, writer = sm.group, sm.global_rank(0)
        items = ((n, tree[""]) for n, tree in self._stage_model_items(model))
        if self.is_writer():
            with atomic_directory(path, owned_model_files(prefix)) as staging:
                dist.broadcast_object_list([str(staging)], src=writer, group=group)  # SYNC POINT
                parts = _write_parts(items, staging, names[0], max_bytes, fmt, 0)
                every: list[Any] = [None] * sm.pp_size
                dist.gather_object(parts, every, dst=writer, group=group)  # SYNC POINT
                _merge_parts(every, staging, names, config)
        elif self._dp_rank() == 0 and self._tp_rank() == 0:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=writer, group=group)  # SYNC POINT
            result: Any
            try:
                result = _write_parts(items, Path(box[0]), names[0], max_bytes, fmt, sm.stage)
            except Exception as exc:  # reported to the writer, which fails the whole save
                result = f"{type(exc).__name__}: {exc}"
            dist.gather_object(result, None, dst=writer, group=group)  # SYNC POINT
        else:
            for _ in items:  # the stage's gathers need every rank
                pass

    def load_optimizer(self, optimizer: Any, checkpoint: Any) -> LoadReport:
        """Like the base class, but each stage matches and loads only the parameters it holds
        (the checkpoint lists every stage's)."""
        source = find_optimizer_checkpoint(checkpoint)
        if source.is_torch_state_dict():
            raise ValueError(
                f"{str(checkpoint)!r} is a positional torch optimizer state dict; a pipeline "
                "stage needs a name-keyed checkpoint (saved by booster.save_optimizer)."
            )
        header = source.header()
        names = self.optimizer_param_names(optimizer)
        shapes = self.optimizer_param_shapes(optimizer, names)
        local = {n for group in names for n in group}
        mine = dict(header)
        mine["param_groups"] = [
            dict(g, params=[n for n in g["params"] if n in local]) for g in header["param_groups"]
        ]
        mapping, report = match_optimizer(names, shapes, mine)
        finish_report(report, "optimizer", source.path, strict=True)
        self.load_optimizer_state(optimizer, names, mine, source.iter_states(), mapping)
        return report

    def _funnel(self, items: Iterator[tuple[str, Tree]]) -> Iterator[tuple[str, Tree]]:
        """Every stage's items on the writer, stage by stage: the writer yields its own, then
        receives each other stage's from that stage's DP 0 / TP 0 rank (which sends them as its
        iteration of ``items`` produces them); all other ranks run ``items`` for its
        collectives."""
        sm = self.pipeline.stage_manager
        sender = self._dp_rank() == 0 and self._tp_rank() == 0 and sm.stage > 0
        if self.is_writer():
            yield from items
            for position in range(1, sm.pp_size):
                yield from receive_items(sm, position)
        elif sender:
            for name, tree in items:
                send_item(sm, name, tree)
            send_item(sm, None, {})
        else:
            for _ in items:
                pass


Part = tuple[str, list[str], int, int]  # provisional file, entry names, bytes, elements


def _write_parts(
    items: Iterator[tuple[str, torch.Tensor]],
    staging: Path,
    single: str,
    max_bytes: int,
    fmt: str,
    stage: int,
) -> list[Part]:
    """Write one stage's entries as shard files under provisional names (one shard in memory)."""
    parts = []
    for number, shard in enumerate(iter_shards(items, max_bytes), start=1):
        name = f".{single}.stage{stage:05d}.part{number:05d}"
        write_tensor_file(shard, staging / name, fmt)
        size, count = sum(nbytes(t) for t in shard.values()), sum(t.numel() for t in shard.values())
        parts.append((name, list(shard), size, count))
        del shard
    return parts


def _merge_parts(
    every: list[Any], staging: Path, names: tuple[str, str], config: str | None
) -> None:
    """Give every stage's shards their final numbers, then write config.json and the index."""
    for position, parts in enumerate(every):
        if isinstance(parts, str):
            raise CheckpointError(f"pipeline stage {position} failed to write its shards: {parts}")
    single, index_name = names
    flat = [part for parts in every for part in parts]
    weight_map: dict[str, str] = {}
    for number, (provisional, entries, _, _) in enumerate(flat, start=1):
        final = shard_file_name(single, number, len(flat))
        os.rename(staging / provisional, staging / final)
        weight_map.update(dict.fromkeys(entries, final))
    fsync_dir(staging)
    metadata = {"total_size": sum(p[2] for p in flat), "total_parameters": sum(p[3] for p in flat)}
    if config is not None:
        write_text_atomic(staging / CONFIG_NAME, config)
    CheckpointIndex(weight_map=weight_map, metadata=metadata).write(staging / index_name)
