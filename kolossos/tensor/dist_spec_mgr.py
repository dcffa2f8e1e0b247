"""``DistSpecManager``: Colossal-AI's entry point for converting a ColoTensor's dist spec."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from kolossos.tensor.colo_tensor import ColoTensor
from kolossos.tensor.distspec import ReplicaSpec, ShardSpec
from kolossos.tensor.process_group import ProcessGroup

__all__ = ["DistSpecManager"]


class DistSpecManager:
    """Static helpers over :meth:`ColoTensor.redistribute`."""

    @staticmethod
    def handle_trans_spec(
        tensor: ColoTensor,
        old_dist_spec: ReplicaSpec | ShardSpec,
        dist_spec: ReplicaSpec | ShardSpec,
        pg: ProcessGroup,
    ) -> ColoTensor:
        """``tensor`` (now in ``old_dist_spec``) converted to ``dist_spec`` on ``pg``.

        Raises:
            ValueError: ``old_dist_spec`` is not the tensor's current spec.
        """
        if tensor.dist_spec != old_dist_spec:
            raise ValueError(
                f"handle_trans_spec: the tensor is in {tensor.dist_spec}, not {old_dist_spec}."
            )
        return tensor.redistribute(dist_spec, pg)

    @staticmethod
    @contextmanager
    def no_grad() -> Iterator[None]:
        """Convert without recording autograd (``torch.no_grad``)."""
        with torch.no_grad():
            yield
