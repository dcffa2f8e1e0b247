"""Helpers of ``colossalai.tensor``: iterate ColoTensor parameters, turn a parameter into one."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from kolossos.tensor.colo_parameter import ColoParameter
from kolossos.tensor.colo_tensor import ColoTensor
from kolossos.tensor.tensor_spec import ColoTensorSpec

__all__ = ["convert_parameter", "full_state_dict", "named_params_with_colotensor"]


def named_params_with_colotensor(
    module: nn.Module, prefix: str = "", recurse: bool = True
) -> Iterator[tuple[str, nn.Parameter | ColoTensor]]:
    """``(name, tensor)`` of the module's parameters, then of ColoTensors held as plain module
    attributes (not registered as parameters); each tensor once."""
    seen: set[int] = set()
    for name, param in module.named_parameters(prefix=prefix, recurse=recurse):
        seen.add(id(param))
        yield name, param
    modules = module.named_modules(prefix=prefix) if recurse else iter([(prefix, module)])
    for mod_prefix, mod in modules:
        for name, value in vars(mod).items():
            if isinstance(value, ColoTensor) and id(value) not in seen:
                seen.add(id(value))
                yield (f"{mod_prefix}.{name}" if mod_prefix else name), value


def convert_parameter(module: nn.Module, param_name: str, spec: ColoTensorSpec) -> ColoParameter:
    """Replace ``module.<param_name>`` by a replicated :class:`ColoParameter` on ``spec.pg``.

    Raises:
        ValueError: the module has no such parameter.
    """
    param = getattr(module, param_name, None)
    if not isinstance(param, nn.Parameter):
        raise ValueError(f"{type(module).__name__} has no parameter {param_name!r}.")
    if isinstance(param, ColoParameter):
        return param
    colo = ColoParameter(param.detach(), requires_grad=param.requires_grad, spec=spec)
    delattr(module, param_name)
    setattr(module, param_name, colo)
    return colo


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every DTensor / ColoParameter gathered to its full, plain
    tensor: the layout of the unsharded model (a Hugging Face model's ``load_state_dict`` or
    ``save_pretrained`` take it as is). COLLECTIVE over the tensors' meshes."""
    return {
        name: (value.full_tensor() if isinstance(value, DTensor) else value).detach()
        for name, value in module.state_dict().items()
    }
