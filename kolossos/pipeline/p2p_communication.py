"""Colossal-AI's ``PipelineP2PCommunication``: send and receive any picklable object (tensors
anywhere inside lists, tuples, dicts, ``ModelOutput``...) to the next or previous stage.

An object travels as its *metadata* (:class:`P2PMetadata`: the pytree structure, each tensor's
shape, dtype and gradient flag, and the non-tensor leaves, pickled) followed by its tensors in
one batch. A sender that knows the receiver already has the metadata passes
``send_metadata=False`` (only for objects made of tensors alone); the receiver then passes the
metadata it expects as ``metadata_recv`` (e.g. from :func:`create_send_metadata`).

Built on :class:`~kolossos.pipeline.p2p_transport.P2PTransport`, one per neighbour, over the
stage manager's two-rank groups: gloo sends CPU tensors, NCCL the accelerator's. Sends return
when the message has gone (as upstream), so the caller may reuse its tensors.
"""

from __future__ import annotations

import pickle
from typing import Any, Literal, NamedTuple, overload

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from kolossos.accelerator import get_accelerator
from kolossos.pipeline.p2p_transport import P2PTransport
from kolossos.pipeline.stage_manager import PipelineStageManager

__all__ = ["P2PMetadata", "PipelineP2PCommunication", "TensorMetadata", "create_send_metadata"]

_MAX_DIMS = 8  # p2p_communicate's shape header


class TensorMetadata(NamedTuple):
    """What a receiver needs to allocate one tensor of a message."""

    shape: torch.Size
    dtype: torch.dtype
    requires_grad: bool


class P2PMetadata(NamedTuple):
    """The structure of a sent object: rebuilt as ``tree_unflatten(leaves, tree_spec)``, the
    tensors (described by ``tensor_metadata``, in order) filling the leaves that are not at
    ``non_tensor_obj_idx``, where ``non_tensor_objs`` go."""

    tree_spec: TreeSpec
    tensor_metadata: list[TensorMetadata]
    non_tensor_obj_idx: list[int]
    non_tensor_objs: list[Any]


@overload
def create_send_metadata(
    object: Any, strict: bool = True, return_tensor: Literal[False] = False
) -> P2PMetadata: ...


@overload
def create_send_metadata(
    object: Any, strict: bool, return_tensor: Literal[True]
) -> tuple[P2PMetadata, list[torch.Tensor]]: ...


@overload
def create_send_metadata(
    object: Any, strict: bool = True, *, return_tensor: Literal[True]
) -> tuple[P2PMetadata, list[torch.Tensor]]: ...


def create_send_metadata(
    object: Any, strict: bool = True, return_tensor: bool = False
) -> P2PMetadata | tuple[P2PMetadata, list[torch.Tensor]]:
    """The metadata describing ``object`` (what is sent ahead of its tensors).

    Args:
        object: a tensor, or a pytree (list, tuple, dict, ``ModelOutput``...) of tensors and
            picklable values.
        strict: refuse non-tensor leaves (an object that can travel without metadata).
        return_tensor: also return the tensors, in leaf order.

    Returns:
        The :class:`P2PMetadata`, or ``(metadata, tensors)`` with ``return_tensor``.

    Raises:
        ValueError: ``strict`` and ``object`` has a leaf that is not a tensor.

    Example:
        >>> meta = create_send_metadata(torch.ones(2, 3))
        >>> meta.tensor_metadata[0].shape
        torch.Size([2, 3])
    """
    meta, tensors = _describe(object)
    if strict and meta.non_tensor_objs:
        kind = type(meta.non_tensor_objs[0]).__name__
        raise ValueError(
            f"create_send_metadata(strict=True) takes tensors only, but the object has "
            f"{len(meta.non_tensor_objs)} other leaves (e.g. {kind}); pass strict=False."
        )
    return (meta, tensors) if return_tensor else meta


def _describe(obj: Any) -> tuple[P2PMetadata, list[torch.Tensor]]:
    """The metadata of ``obj`` and its tensors, in leaf order."""
    leaves, spec = tree_flatten(obj)
    tensor_meta, tensors, idx, others = [], [], [], []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
            tensor_meta.append(TensorMetadata(leaf.shape, leaf.dtype, leaf.requires_grad))
        else:
            idx.append(i)
            others.append(leaf)
    return P2PMetadata(spec, tensor_meta, idx, others), tensors


def _rebuild(meta: P2PMetadata, tensors: list[torch.Tensor]) -> Any:
    leaves: list[Any] = list(tensors)
    for i, obj in zip(meta.non_tensor_obj_idx, meta.non_tensor_objs, strict=True):
        leaves.insert(i, obj)
    return tree_unflatten(leaves, meta.tree_spec)


def _device_of(group: ProcessGroup) -> torch.device:
    """NCCL moves accelerator tensors; gloo (and the rest) CPU tensors."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return get_accelerator().get_current_device()
    return torch.device("cpu")


class PipelineP2PCommunication:
    """Objects to and from the neighbouring stages, under Colossal-AI's names.

    Peers default to the stage manager's ``get_next_rank()`` / ``get_prev_rank()`` and may be
    any global rank sharing a point-to-point group with this one
    (:meth:`~kolossos.pipeline.PipelineStageManager.get_p2p_process_group`).

    Args:
        stage_manager: this rank's :class:`~kolossos.pipeline.PipelineStageManager`.

    Example:
        >>> p2p = PipelineP2PCommunication(stage_manager)  # doctest: +SKIP
        >>> if stage_manager.is_first_stage():  # doctest: +SKIP
        ...     p2p.send_forward({"hidden": h, "step": 3})
        ... else:
        ...     inputs = p2p.recv_forward()
    """

    def __init__(self, stage_manager: PipelineStageManager) -> None:
        self.stage_manager = stage_manager
        self._links: dict[int, P2PTransport] = {}

    def link(self, peer: int) -> P2PTransport:
        """The transport to global rank ``peer`` (created on first use).

        Raises:
            ValueError: ``peer`` shares no point-to-point group with this rank.
        """
        if peer not in self._links:
            sm = self.stage_manager
            group = sm.get_p2p_process_group(sm.get_rank(), peer)
            self._links[peer] = P2PTransport(group, device=_device_of(group))
        return self._links[peer]

    # --- Colossal-AI's API -------------------------------------------------------------------
    def recv_forward(
        self, prev_rank: int | None = None, metadata_recv: P2PMetadata | None = None
    ) -> Any:
        """Receive this stage's input from the previous stage (blocking).

        Args:
            prev_rank: the sender (default: the previous pipeline position).
            metadata_recv: the metadata the sender skipped (``send_metadata=False``).
        """
        peer = self.stage_manager.get_prev_rank() if prev_rank is None else prev_rank
        return self._recv(peer, metadata_recv)

    def recv_backward(
        self, next_rank: int | None = None, metadata_recv: P2PMetadata | None = None
    ) -> Any:
        """Receive the gradient of this stage's output from the next stage (blocking).

        Args:
            next_rank: the sender (default: the next pipeline position).
            metadata_recv: the metadata the sender skipped (``send_metadata=False``).
        """
        peer = self.stage_manager.get_next_rank() if next_rank is None else next_rank
        return self._recv(peer, metadata_recv)

    def send_forward(
        self, output_object: Any, next_rank: int | None = None, send_metadata: bool = True
    ) -> None:
        """Send this stage's output to the next stage.

        Args:
            output_object: a tensor or a picklable pytree of tensors and values.
            next_rank: the receiver (default: the next pipeline position).
            send_metadata: send the metadata first (always done when the object has non-tensor
                leaves); ``False`` when the receiver passes ``metadata_recv``.
        """
        peer = self.stage_manager.get_next_rank() if next_rank is None else next_rank
        self._send(peer, output_object, send_metadata)

    def send_backward(
        self, input_object: Any, prev_rank: int | None = None, send_metadata: bool = True
    ) -> None:
        """Send the gradient of this stage's input to the previous stage (arguments as
        :meth:`send_forward`; ``prev_rank`` defaults to the previous pipeline position)."""
        peer = self.stage_manager.get_prev_rank() if prev_rank is None else prev_rank
        self._send(peer, input_object, send_metadata)

    def send_forward_recv_backward(
        self,
        input_object: Any,
        next_rank: int | None = None,
        send_metadata: bool = True,
        metadata_recv: P2PMetadata | None = None,
        send_prior_fallback: bool | None = None,
    ) -> Any:
        """Send to the next stage and receive from it: one batch when no metadata travels,
        otherwise a send and a receive in the order ``send_prior_fallback`` says (the peer
        must use the opposite order).

        Raises:
            ValueError: metadata travels and ``send_prior_fallback`` is ``None``.
        """
        peer = self.stage_manager.get_next_rank() if next_rank is None else next_rank
        return self._send_recv(peer, input_object, send_metadata, metadata_recv,
                               send_prior_fallback)  # fmt: skip

    def send_backward_recv_forward(
        self,
        input_object: Any,
        prev_rank: int | None = None,
        send_metadata: bool = True,
        metadata_recv: P2PMetadata | None = None,
        send_prior_fallback: bool | None = None,
    ) -> Any:
        """Send to the previous stage and receive from it (as
        :meth:`send_forward_recv_backward`, with the previous pipeline position)."""
        peer = self.stage_manager.get_prev_rank() if prev_rank is None else prev_rank
        return self._send_recv(peer, input_object, send_metadata, metadata_recv,
                               send_prior_fallback)  # fmt: skip

    def p2p_communicate(
        self,
        output_object: Any,
        recv_pre: bool,
        next_rank: int | None = None,
        comm_dtype: torch.dtype = torch.float16,
    ) -> torch.Tensor | None:
        """Send a tensor (or ``None``: nothing) to ``next_rank`` and, with ``recv_pre``,
        receive one from it in the same batch (the two-stage exchange). The tensor travels as
        ``comm_dtype``, preceded by its shape.

        Returns:
            The received tensor (``comm_dtype``), or ``None`` without ``recv_pre``.

        Raises:
            TypeError: ``output_object`` is neither a tensor nor ``None``.
            ValueError: a tensor of more than 8 dimensions.
        """
        if output_object is not None and not isinstance(output_object, torch.Tensor):
            raise TypeError(
                f"p2p_communicate sends one tensor, got {type(output_object).__name__}; use "
                "send_forward for other objects."
            )
        peer = self.stage_manager.get_next_rank() if next_rank is None else next_rank
        link = self.link(peer)
        send: list[torch.Tensor] = []
        if output_object is not None:
            if output_object.dim() > _MAX_DIMS:
                raise ValueError(
                    f"p2p_communicate sends tensors of at most {_MAX_DIMS} dimensions, got "
                    f"{output_object.dim()}; reshape it or use send_forward."
                )
            shape = [output_object.dim(), *output_object.shape]
            header = torch.tensor(shape + [0] * (_MAX_DIMS + 1 - len(shape)), dtype=torch.int64)
            send = [header.to(link.device)]
        got = [torch.empty(_MAX_DIMS + 1, dtype=torch.int64, device=link.device)]
        got = got if recv_pre else []
        link.exchange(peer, send, peer, got)
        if output_object is not None:
            send = [output_object.detach().to(link.device, comm_dtype)]
        recv: list[torch.Tensor] = []
        if recv_pre:
            words = got[0].tolist()
            recv = [torch.empty(words[1 : 1 + words[0]], dtype=comm_dtype, device=link.device)]
        link.exchange(peer, send, peer, recv)
        return recv[0] if recv else None

    # --- plumbing -----------------------------------------------------------------------------
    def _send(self, peer: int, obj: Any, send_metadata: bool) -> None:
        link = self.link(peer)
        meta, tensors = _describe(obj)
        if send_metadata or meta.non_tensor_obj_idx:
            size, data = _pickled(meta, link.device)
            link.isend(peer, [size])
            link.isend(peer, [data])
            link.stats.metadata_sent += 1
        link.isend(peer, [t.detach().to(link.device) for t in tensors])
        link.stats.messages_sent += 1
        link.wait_sends()

    def _recv(self, peer: int, metadata: P2PMetadata | None) -> Any:
        _check_given(metadata)
        link = self.link(peer)
        if metadata is None:
            size = torch.empty(1, dtype=torch.int64, device=link.device)
            link.recv(peer, [size])
            data = torch.empty(int(size.item()), dtype=torch.uint8, device=link.device)
            link.recv(peer, [data])
            metadata = pickle.loads(data.cpu().numpy().tobytes())
            link.stats.metadata_received += 1
        tensors = _buffers(metadata, link.device)
        link.recv(peer, tensors)
        link.stats.messages_received += 1
        return _rebuild(metadata, _mark_grad(tensors, metadata))

    def _send_recv(
        self,
        peer: int,
        obj: Any,
        send_metadata: bool,
        metadata_recv: P2PMetadata | None,
        send_first: bool | None,
    ) -> Any:
        _check_given(metadata_recv)
        meta, tensors = _describe(obj)
        send_metadata = send_metadata or bool(meta.non_tensor_obj_idx)
        if not send_metadata and metadata_recv is not None:  # tensors only: one batch
            link = self.link(peer)
            recv = _buffers(metadata_recv, link.device)
            link.exchange(peer, [t.detach().to(link.device) for t in tensors], peer, recv)
            link.stats.messages_sent += 1
            link.stats.messages_received += 1
            return _rebuild(metadata_recv, _mark_grad(recv, metadata_recv))
        if send_first is None:
            raise ValueError(
                "metadata travels in this exchange, so the send and the receive are done one "
                "after the other; pass send_prior_fallback=True on one side and False on the "
                "other (or send_metadata=False with metadata_recv=... on both)."
            )
        if send_first:
            self._send(peer, obj, send_metadata)
            return self._recv(peer, metadata_recv)
        received = self._recv(peer, metadata_recv)
        self._send(peer, obj, send_metadata)
        return received


def _pickled(meta: P2PMetadata, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The metadata as ``(size, bytes)`` tensors on ``device``."""
    payload = bytearray(pickle.dumps(meta))
    data = torch.frombuffer(payload, dtype=torch.uint8).to(device)
    return torch.tensor([len(payload)], dtype=torch.int64, device=device), data


def _check_given(meta: P2PMetadata | None) -> None:
    """A caller's ``metadata_recv`` must describe tensors only (an object with other leaves
    always travels with its metadata)."""
    if meta is not None and meta.non_tensor_obj_idx:
        raise ValueError(
            f"metadata_recv describes {len(meta.non_tensor_obj_idx)} non-tensor leaves, so the "
            "sender sends metadata anyway; pass metadata_recv only for objects of tensors "
            "(create_send_metadata(obj) with strict=True), or None."
        )


def _buffers(meta: P2PMetadata, device: torch.device) -> list[torch.Tensor]:
    return [torch.empty(m.shape, dtype=m.dtype, device=device) for m in meta.tensor_metadata]


def _mark_grad(tensors: list[torch.Tensor], meta: P2PMetadata) -> list[torch.Tensor]:
    """Received tensors whose sender tracked gradients require gradients (as leaves)."""
    for t, m in zip(tensors, meta.tensor_metadata, strict=True):
        if m.requires_grad:
            t.requires_grad_(True)
    return tensors
