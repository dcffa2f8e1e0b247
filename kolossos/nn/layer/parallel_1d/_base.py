"""What every 1D tensor-parallel layer shares: the group, building sharded parameters from full
tensors, recognising Hugging Face's ``Conv1D``, and gathering full weights for checkpoints."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from kolossos.nn.layer.parallel_1d.sharding import (
    MARK_ATTRS,
    TPShardSpec,
    gather_tp_full,
    get_tp_spec,
    set_tp_spec,
    slice_tp_shard,
)

__all__ = [
    "LINEAR_SEQ_PARALLEL_MODES",
    "SEQ_PARALLEL_MODES",
    "GroupArg",
    "ParallelModule1D",
    "check_seq_parallel_mode",
    "deepcopy_sharing_group",
    "is_conv1d",
    "reject_positional",
    "resolve_group",
    "resolve_seq_parallel",
    "single_group",
    "to_factory",
    "trainable",
]

SEQ_PARALLEL_MODES = ("split_gather",)
"""Sequence-parallel modes every 1D layer implements (Megatron's all-gather in, reduce-scatter
out). Colossal-AI's other modes are attention-level schemes and raise ``NotImplementedError``."""

LINEAR_SEQ_PARALLEL_MODES = ("split_gather", "ring")
"""The linear layers also implement ``'ring'``: the same sharding, the all-gather and
reduce-scatter done as a ring of exchanges overlapped with the matmul (``ring_ops``)."""


GroupArg = ProcessGroup | list[ProcessGroup] | tuple[ProcessGroup, ...] | None
"""A process group as the layers accept it: a group, a one-element list of one (Colossal-AI's
sharder passes those), or ``None`` for the world."""


def reject_positional(owner: str, args: tuple[Any, ...]) -> None:
    """Refuse positional options to ``from_native_module`` (Colossal-AI's signature has
    ``*args``, but they would land on the constructor's first parameters).

    Raises:
        TypeError: ``args`` is not empty.
    """
    if args:
        raise TypeError(
            f"{owner}.from_native_module: got {len(args)} positional option(s) {args!r}; pass "
            "the layer's options by keyword (e.g. gather_output=True)."
        )


def check_seq_parallel_mode(
    mode: str | None, allowed: tuple[str, ...] = SEQ_PARALLEL_MODES
) -> str | None:
    """Validate a ``seq_parallel_mode`` option (``None`` or one of ``allowed``)."""
    if mode is None or mode in allowed:
        return mode
    raise NotImplementedError(
        f"seq_parallel_mode={mode!r} is not implemented by this 1D layer; use one of "
        f"{allowed} (Megatron sequence parallelism) or None."
    )


def resolve_seq_parallel(
    owner: str,
    seq_parallel_mode: str | None,
    seq_parallel: bool,
    seq_dim: int | None,
    seq_parallel_dim: int,
) -> tuple[str | None, int]:
    """Merge kolossos' ``seq_parallel_mode`` / ``seq_dim`` with Colossal-AI's ``seq_parallel``
    (``True`` means ``"split_gather"``) / ``seq_parallel_dim`` into ``(mode, dim)``.

    Raises:
        TypeError: ``seq_parallel`` is not a bool.
        ValueError: ``seq_dim`` and ``seq_parallel_dim`` name different dimensions.
        NotImplementedError: an unsupported mode.
    """
    if not isinstance(seq_parallel, bool):
        raise TypeError(f"{owner}: seq_parallel={seq_parallel!r} must be a bool.")
    if seq_parallel_mode is None and seq_parallel:
        seq_parallel_mode = SEQ_PARALLEL_MODES[0]
    mode = check_seq_parallel_mode(seq_parallel_mode, LINEAR_SEQ_PARALLEL_MODES)
    if seq_dim is None:
        return mode, seq_parallel_dim
    if seq_parallel_dim != 1 and seq_parallel_dim != seq_dim:
        raise ValueError(
            f"{owner}: seq_dim={seq_dim} and seq_parallel_dim={seq_parallel_dim} name different "
            "sequence dimensions; they are the same option, pass only one of them."
        )
    return mode, seq_dim


def single_group(process_group: GroupArg) -> ProcessGroup | None:
    """``process_group``, unwrapped from the one-element list Colossal-AI's sharder may pass.

    Raises:
        ValueError: a list or tuple that does not hold exactly one group.
    """
    if isinstance(process_group, (list, tuple)):
        if len(process_group) != 1:
            raise ValueError(
                f"1D tensor-parallel layers use one process group, got a list of "
                f"{len(process_group)}; pass the tensor-parallel group itself."
            )
        return process_group[0]
    return process_group


def to_factory(
    tensor: torch.Tensor | None,
    device: torch.device | str | None,
    dtype: torch.dtype | None,
) -> torch.Tensor | None:
    """``tensor`` moved to ``device`` / cast to ``dtype`` where given (as Colossal-AI's layers do
    with the weights they are handed); a parameter keeps its ``requires_grad``."""
    if tensor is None or (device is None and dtype is None):
        return tensor
    same_dtype = dtype is None or tensor.dtype == dtype
    if same_dtype and (device is None or tensor.device == torch.device(device)):
        return tensor
    moved = tensor.detach().to(device=device, dtype=dtype)
    if isinstance(tensor, nn.Parameter):
        return nn.Parameter(moved, requires_grad=tensor.requires_grad)
    return moved


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is Hugging Face's ``Conv1D`` (a linear layer whose weight is stored
    ``(in_features, out_features)``, as in GPT-2), recognised without importing transformers."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "weight")


def trainable(tensor: torch.Tensor) -> bool:
    """Whether a parameter sliced from ``tensor`` should require gradients: a frozen source
    parameter stays frozen; fresh tensors are trainable."""
    return tensor.requires_grad if isinstance(tensor, nn.Parameter) else True


def resolve_group(process_group: GroupArg) -> ProcessGroup:
    """``process_group`` (or the one group of a one-element list, see :func:`single_group`), or
    the default (world) group when ``None``."""
    process_group = single_group(process_group)
    if not dist.is_initialized():
        raise RuntimeError(
            "tensor-parallel layers need torch.distributed; call kolossos.launch(...) (or "
            "torch.distributed.init_process_group) before building them."
        )
    group = process_group if process_group is not None else dist.group.WORLD
    assert group is not None
    return group


def deepcopy_sharing_group(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """``copy.deepcopy`` of a module that holds a process group: the copy shares the group (a
    communicator handle cannot be copied) and copies everything else."""
    group = module.__dict__.get("process_group")
    if group is not None:
        memo[id(group)] = group
    new = type(module).__new__(type(module))
    memo[id(module)] = new
    new.__dict__.update(copy.deepcopy(module.__dict__, memo))
    return new


class ParallelModule1D(nn.Module):
    """Base of the 1D layers: owns :attr:`process_group` and gathers full parameters."""

    process_group: ProcessGroup

    def __deepcopy__(self, memo: dict[int, Any]) -> nn.Module:
        # torch's Parameter.__deepcopy__ drops tensor attributes: carry the shard marks over.
        marks = self._param_marks()
        new = deepcopy_sharing_group(self, memo)
        assert isinstance(new, ParallelModule1D)
        new._restore_param_marks(marks)
        return new

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        # load_state_dict(assign=True) puts new Parameter objects in place: keep the marks.
        marks = self._param_marks()
        super()._load_from_state_dict(*args, **kwargs)
        self._restore_param_marks(marks)

    def _param_marks(self) -> dict[str, dict[str, Any]]:
        return {
            name: {k: v for k, v in vars(p).items() if k in MARK_ATTRS}
            for name, p in self._parameters.items()
            if p is not None
        }

    def _restore_param_marks(self, marks: dict[str, dict[str, Any]]) -> None:
        for name, attrs in marks.items():
            param = self._parameters.get(name)
            if param is not None:
                for key, value in attrs.items():
                    setattr(param, key, value)

    def _init_group(self, process_group: GroupArg) -> None:
        self.process_group = resolve_group(process_group)
        self.tp_size = dist.get_world_size(self.process_group)
        self.tp_rank = dist.get_rank(self.process_group)

    def _shard_param(
        self,
        full: torch.Tensor,
        dim: int | None,
        *,
        fused_sections: tuple[int, ...] | None = None,
        padded: int = 0,
        requires_grad: bool = True,
    ) -> nn.Parameter:
        """A parameter holding this rank's shard of ``full`` split along ``dim`` (a replicated
        copy when ``dim`` is ``None``), with its :class:`TPShardSpec` attached."""
        if dim is None:
            return nn.Parameter(full.detach().clone(), requires_grad=requires_grad)
        spec = TPShardSpec(
            dim=dim,
            full_shape=tuple(full.shape),
            fused_sections=fused_sections,
            padded=padded,
            group=self.process_group,
        )
        param = nn.Parameter(slice_tp_shard(full.detach(), spec, self.tp_rank), requires_grad)
        set_tp_spec(param, spec)
        return param

    def _empty_shard(
        self,
        full_shape: tuple[int, ...],
        dim: int | None,
        *,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
        fused_sections: tuple[int, ...] | None = None,
        padded: int = 0,
    ) -> nn.Parameter:
        """An uninitialised parameter of this rank's shard shape (the full shape when ``dim`` is
        ``None``), with its :class:`TPShardSpec` attached, for an initializer to fill."""
        if dim is None:
            return nn.Parameter(torch.empty(full_shape, device=device, dtype=dtype))
        spec = TPShardSpec(
            dim=dim,
            full_shape=full_shape,
            fused_sections=fused_sections,
            padded=padded,
            group=self.process_group,
        )
        param = nn.Parameter(torch.empty(spec.shard_shape(), device=device, dtype=dtype))
        set_tp_spec(param, spec)
        return param

    def full_weight(self) -> torch.Tensor:
        """The full (unsharded, unpadded) weight. COLLECTIVE over :attr:`process_group` when the
        weight is sharded."""
        weight = self.get_parameter("weight")
        return self.full_parameter(weight)

    def full_parameter(self, param: torch.Tensor) -> torch.Tensor:
        """The full value of one of this layer's parameters (gathered if sharded). COLLECTIVE
        over :attr:`process_group` when ``param`` is sharded."""
        spec = get_tp_spec(param)
        if spec is None:
            return param.detach().clone()
        return gather_tp_full(param.detach(), spec)

    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer of this layer (not of its children) at full size, by local
        name. COLLECTIVE over :attr:`process_group`."""
        state = {name: self.full_parameter(p) for name, p in self.named_parameters(recurse=False)}
        for name, buffer in self.named_buffers(recurse=False):
            state[name] = buffer.detach().clone()
        return state
