"""Moving checkpoint items between pipeline stages: every stage's first rank streams its items
(names, tensors, plain values) to the checkpoint writer, pipeline position 0, one item at a
time (so at most one item is in flight)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from kolossos.cluster.collectives import comm_device
from kolossos.pipeline import PipelineStageManager

__all__ = ["receive_items", "send_item"]


def _transport(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``tensor`` where ``group``'s backend sends from (the CPU for gloo), contiguous."""
    return tensor.detach().to(comm_device(group)).contiguous()


def send_item(manager: PipelineStageManager, name: str | None, tree: dict[str, Any]) -> None:
    """Send one checkpoint item (``name`` and its values: tensors and plain values) to the
    writer, position 0 of this pipeline; ``name=None`` ends the stream. The structure travels
    as an object, then each tensor (a point-to-point collective with :func:`receive_items`)."""
    group, writer = manager.group, manager.global_rank(0)
    tensors = {k: v for k, v in tree.items() if isinstance(v, torch.Tensor)}
    head = {
        k: ("t", tuple(v.shape), v.dtype) if k in tensors else ("v", v) for k, v in tree.items()
    }
    dist.send_object_list([None if name is None else (name, head)], dst=writer, group=group)
    for value in tensors.values():
        dist.send(_transport(value, group), dst=writer, group=group)  # SYNC POINT


def receive_items(
    manager: PipelineStageManager, position: int
) -> Iterator[tuple[str, dict[str, Any]]]:
    """On the writer: the items pipeline position ``position`` sends, until its end."""
    group, src = manager.group, manager.global_rank(position)
    while True:
        box: list[Any] = [None]
        dist.recv_object_list(box, src=src, group=group)  # SYNC POINT
        if box[0] is None:
            return
        name, head = box[0]
        tree: dict[str, Any] = {}
        for key, (kind, *rest) in head.items():
            if kind == "v":
                tree[key] = rest[0]
                continue
            buf = _transport(torch.empty(rest[0], dtype=rest[1]), group)
            dist.recv(buf, src=src, group=group)
            tree[key] = buf.cpu()
        yield name, tree
