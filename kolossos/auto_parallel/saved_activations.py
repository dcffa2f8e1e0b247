"""Which activations a training step holds: the tensors autograd saves for backward, found by
running the traced ATen graph once on fake tensors (nothing real is allocated).

Each node of the graph is run in order by an interpreter under ``FakeTensorMode`` with the
parameters requiring gradients, inside ``torch.autograd.graph.saved_tensors_hooks``. A saved
tensor is traced back to the node whose output owns its storage; every storage counts once
(a view saved by three operators is one tensor). The graph's outputs (the logits a Hugging Face
model returns) are held until the step ends and count too. Parameters and inputs are not
activations and are left out. Attention on the CPU is run by the flash kernel eager mode picks
(fake tensors would pick the math path and count the attention weights).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef

from kolossos.auto_parallel.traced_graph import TracedGraph

__all__ = ["saved_activation_bytes"]


def _storage_key(tensor: torch.Tensor) -> Any:
    return StorageWeakRef(tensor.untyped_storage()).cdata


def _cpu_flash(args: Any) -> bool:
    query = args[0]
    return bool(query.device.type == "cpu" and query.dtype in (torch.float32, torch.bfloat16))


def _flash_for_cpu(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Eager CPU attention runs the flash kernel (it keeps the output and the log-sum-exp);
    fake tensors would pick the math path, which keeps the attention weights."""
    if enable_gqa:
        raise NotImplementedError("saved_activation_bytes: grouped-query attention")
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )
    return out[0]


class _Recorder(fx.Interpreter):
    def __init__(self, module: fx.GraphModule) -> None:
        super().__init__(module)
        self.producer: dict[Any, str] = {}
        self.nbytes: dict[Any, int] = {}
        self.current = ""
        self.alive: list[torch.Tensor] = []

    def note(self, tensor: torch.Tensor) -> Any:
        """The key of ``tensor``'s storage; one made inside a composite operator (the
        log-softmax of ``cross_entropy_loss``) belongs to the node running now."""
        key = _storage_key(tensor)
        # Keep every tensor alive: a freed storage's address (the key) could be reused.
        self.alive.append(tensor)
        if key not in self.producer:
            self.producer[key] = self.current
            self.nbytes[key] = tensor.untyped_storage().nbytes()
        return key

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if target is torch.ops.aten.scaled_dot_product_attention.default and _cpu_flash(args):
            return _flash_for_cpu(*args, **kwargs)
        return super().call_function(target, args, kwargs)

    def run_node(self, n: fx.Node) -> Any:
        self.current = n.name
        result = super().run_node(n)
        values = result if isinstance(result, (tuple, list)) else [result]
        for value in values:
            if isinstance(value, torch.Tensor):
                self.note(value)
        return result


def saved_activation_bytes(traced: TracedGraph) -> dict[str, float]:
    """Bytes held from forward to backward, by the graph node that produced them.

    ``traced`` must come from ``ColoTracer(backend="export")`` (placeholders carry fake values).
    """
    gm = traced.graph_module
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    recorder = _Recorder(gm)
    saved: set[Any] = set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.add(recorder.note(tensor))
        return tensor

    with mode:
        args = []
        for node in placeholders:
            value = node.meta["val"]
            if not isinstance(value, torch.Tensor):  # a plain input (use_cache=False)
                args.append(value)
                continue
            fake = torch.empty_strided(
                value.shape, value.stride(), dtype=value.dtype, device=value.device
            )
            if node.name.startswith("p_") and fake.is_floating_point():
                fake.requires_grad_(True)
            args.append(fake)
        # The placeholders' own storages are parameters and inputs: never activations.
        inputs = {_storage_key(a) for a in args if isinstance(a, torch.Tensor)}
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            outputs = recorder.run(*args)
    for value in outputs if isinstance(outputs, (tuple, list)) else [outputs]:
        if isinstance(value, torch.Tensor):
            saved.add(_storage_key(value))
    result: dict[str, float] = {}
    for key in saved - inputs:
        node = recorder.producer.get(key)
        if node is not None:
            result[node] = result.get(node, 0.0) + float(recorder.nbytes[key])
    return result
