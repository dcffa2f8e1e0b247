"""``FSDPCheckpointIO``: checkpoints of FSDP2 models in two formats, loadable anywhere.

* **Gathered** (the default, and always for ``shard=False``): Hugging Face model files and the
  name-keyed optimizer format, exactly what every other plugin writes and reads. Each
  ``DTensor`` shard is gathered one tensor at a time; the first data-parallel rank writes.
* **DCP** (``shard=True`` with ``checkpoint_format='dcp'``, or ``gather_dtensor=False``): a
  ``torch.distributed.checkpoint`` directory, every rank writing only its own shards — for
  models whose full tensors should never meet in one process.

Loading detects the format: a directory with DCP's ``.metadata`` is read with DCP (resharding to
this run's layout, or into a plain model), anything else as the gathered formats, cutting each
full tensor down to this rank's shard without communication.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from kolossos.checkpoint_io import GeneralCheckpointIO, LoadReport
from kolossos.checkpoint_io.read_plan import ReadPlan, Selector, narrow_selector
from kolossos.checkpoint_io.state_check import unique_tensors
from kolossos.fsdp.dcp import _reshard, find_dcp_directory, load_model_dcp, save_model_dcp
from kolossos.fsdp.dcp_optimizer import load_optimizer_dcp, save_optimizer_dcp
from kolossos.interface import unwrap_model

__all__ = ["FSDPCheckpointIO", "shard_like"]


def shard_like(value: Any, target: Any) -> Any:
    """``value`` (a full tensor) cut down to ``target``'s ``DTensor`` shard, on the device and
    in the layout of ``target``'s local tensor (so CPU-offloaded shards stay in CPU memory).
    Anything else is returned as it is. No communication: every rank has the full tensor."""
    from torch.distributed.tensor import DTensor

    if (
        not isinstance(target, DTensor)
        or not isinstance(value, torch.Tensor)
        or isinstance(value, DTensor)
    ):
        return value
    home = target.to_local()
    if tuple(value.shape) == tuple(target.shape):
        local = value
        for dim, start, stop in _shard_ranges(target):
            local = local.narrow(dim, start, stop - start)
    elif tuple(value.shape) == tuple(home.shape):  # already this rank's shard (a read plan)
        local = value
    else:
        return value
    return DTensor.from_local(
        local.to(home.device),
        target.device_mesh,
        target.placements,
        run_check=False,
        shape=target.shape,
        stride=target.stride(),
    )


def _shard_ranges(target: Any) -> list[tuple[int, int, int]]:
    """``(dim, start, stop)`` of this rank's shard of DTensor ``target`` in the full tensor
    (``torch.chunk`` semantics along each sharded dimension, as DTensor and FSDP2 cut)."""
    mesh = target.device_mesh
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "a rank outside the mesh holds a shard"
    shape = list(target.shape)
    ranges: list[tuple[int, int, int]] = []
    for mesh_dim, placement in enumerate(target.placements):
        if not placement.is_shard():
            continue
        dim = placement.dim
        size = shape[dim]
        step = -(-size // mesh.size(mesh_dim)) if size else 0
        start = min(coordinate[mesh_dim] * step, size)
        stop = min(start + step, size)
        ranges.append((dim, start, stop))
        shape[dim] = stop - start
    return ranges


def shard_read_plan(module: nn.Module) -> ReadPlan:
    """Read only this rank's rows of every DTensor entry of ``module``'s state dict."""
    from torch.distributed.tensor import DTensor

    plan: dict[str, Selector | None] = {}
    for name, target in module.state_dict(keep_vars=True).items():
        if isinstance(target, DTensor):
            ranges = _shard_ranges(target)
            if len({dim for dim, _, _ in ranges}) == len(ranges) == 1:
                plan[name] = narrow_selector(ranges)
    return plan


def _distinct(tensor: torch.Tensor, index: int) -> torch.Tensor:
    """``tensor`` copied to storage offset ``index + 1`` of a fresh buffer.

    The writer drops tied duplicates by storage identity (pointer, offset, shape, ...). Gathered
    tensors are temporaries: once a shard is written, a later gathered tensor of the same shape
    may reuse a freed one's memory and be mistaken for its alias (and silently left out). A
    distinct offset per entry rules that out; the writer copies such views compactly anyway.
    """
    buffer = torch.empty(tensor.numel() + index + 1, dtype=tensor.dtype, device=tensor.device)
    view = buffer[index + 1 :].view(tensor.shape)
    view.copy_(tensor)
    return view


class FSDPCheckpointIO(GeneralCheckpointIO):
    """Checkpoint IO of :class:`~kolossos.booster.plugin.TorchFSDPPlugin` (see the module doc).

    Args:
        process_group: the data-parallel group (its first rank writes gathered checkpoints).
        checkpoint_format: ``'hf'`` or ``'dcp'``: what ``shard=True`` saves write.

    Example:
        >>> io = FSDPCheckpointIO(checkpoint_format="dcp")
        >>> io.save_model(model, "ckpt/model", shard=True)  # doctest: +SKIP
        >>> io.load_model(plain_model, "ckpt/model")  # DCP detected  # doctest: +SKIP
    """

    def __init__(self, process_group: Any | None = None, checkpoint_format: str = "hf") -> None:
        if checkpoint_format not in ("hf", "dcp"):
            raise ValueError(f"checkpoint_format={checkpoint_format!r} must be 'hf' or 'dcp'.")
        super().__init__(process_group)
        self.checkpoint_format = checkpoint_format

    def _use_dcp(self, shard: bool, gather_dtensor: bool, prefix: str | None) -> bool:
        if not gather_dtensor and not shard:
            raise ValueError(
                "gather_dtensor=False (each rank writes its own shards) needs shard=True: a "
                "single file can only hold gathered tensors."
            )
        dcp = shard and (self.checkpoint_format == "dcp" or not gather_dtensor)
        if dcp and prefix:
            raise ValueError(
                f"prefix={prefix!r} is not supported for DCP checkpoints (one per directory); "
                "save into a directory of its own."
            )
        return dcp

    # ------------------------------------------------------------------ model
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
        """Save gathered Hugging Face files, or (see the class doc) a DCP directory, in which
        case ``size_per_shard`` does not apply (one file per rank) and ``use_safetensors`` and
        ``use_async`` are refused."""
        if self._use_dcp(shard, gather_dtensor, prefix):
            _refuse_async_dcp(use_async)
            if use_safetensors:
                raise ValueError(
                    "use_safetensors=True writes Hugging Face files; DCP checkpoints use DCP's own "
                    "file format. Pass checkpoint_format='hf' (or gather_dtensor=True) for them."
                )
            save_model_dcp(self, model, checkpoint)
            return
        _reshard(unwrap_model(model))
        super().save_model(
            model, checkpoint, shard, True, prefix, size_per_shard, use_safetensors, use_async
        )

    def load_model(
        self, model: nn.Module, checkpoint: str | os.PathLike[str], strict: bool = True
    ) -> LoadReport:
        """Load any model checkpoint: DCP directories with DCP, the rest as usual."""
        directory = find_dcp_directory(checkpoint)
        if directory is not None:
            return load_model_dcp(self, model, directory, strict)
        _reshard(unwrap_model(model))
        return super().load_model(model, checkpoint, strict)

    def model_state_items(
        self, model: nn.Module, gather_dtensor: bool
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Each state entry gathered into a full tensor (collective: all ranks gather, one tensor
        at a time). Tied entries are yielded once, under their first name: gathered copies no
        longer share memory, so the writer could not tell them apart afterwards."""
        state = unwrap_model(model).state_dict()
        aliases: dict[str, str] = {}
        for _ in unique_tensors(state.items(), aliases):  # identity of the shards
            pass
        for index, (name, value) in enumerate(state.items()):
            if name in aliases:
                continue
            if hasattr(value, "full_tensor"):
                value = _distinct(value.full_tensor(), index)  # collective
            yield name, value

    def model_read_plan(self, model: nn.Module) -> ReadPlan:
        """Read only this rank's ``fully_shard`` rows of each sharded tensor."""
        return shard_read_plan(unwrap_model(model))

    def place(self, value: Any, target: Any) -> Any:
        """This rank's shard of a full tensor (:func:`shard_like`), on the device (and in the
        memory) of the shard it replaces."""
        return shard_like(value, target)

    # ------------------------------------------------------------------ optimizer
    def save_optimizer(
        self,
        optimizer: Any,
        checkpoint: str | os.PathLike[str],
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: float = 1024,
        use_async: bool = False,
    ) -> None:
        """Save the name-keyed optimizer format (gathered), or a DCP directory (not with
        ``use_async``)."""
        if self._use_dcp(shard, gather_dtensor, prefix):
            _refuse_async_dcp(use_async)
            save_optimizer_dcp(self, optimizer, checkpoint)
            return
        super().save_optimizer(
            optimizer, checkpoint, shard, True, prefix, size_per_shard, use_async
        )

    def load_optimizer(self, optimizer: Any, checkpoint: str | os.PathLike[str]) -> LoadReport:
        """Load any optimizer checkpoint: DCP directories with DCP, the rest as usual."""
        directory = find_dcp_directory(checkpoint)
        if directory is not None:
            return load_optimizer_dcp(self, optimizer, directory)
        return super().load_optimizer(optimizer, checkpoint)


def _refuse_async_dcp(use_async: bool) -> None:
    if use_async:
        raise NotImplementedError(
            "use_async=True is not available for DCP checkpoints (checkpoint_format='dcp', or "
            "gather_dtensor=False). Save Hugging Face files asynchronously with "
            "checkpoint_format='hf' and gather_dtensor=True, or save DCP synchronously."
        )
