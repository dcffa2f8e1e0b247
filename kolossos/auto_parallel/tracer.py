"""``ColoTracer``: a static graph of a model with shape, dtype, bytes and FLOPs on every node.

Nothing is computed on real data. Inputs are given as meta tensors (or any tensors: only their
shape and dtype count) and the graph is run under a ``FakeTensorMode``, so a model of any size is
traced without allocating its activations. Two front ends give the graph:

* ``torch.fx`` symbolic tracing for plain modules (a torch-level graph: one node per module call
  or function);
* ``torch.export`` (non-strict) for Hugging Face models, whose forward uses Python control flow
  that ``torch.fx`` cannot follow (Transformers 5 also dropped its own fx tracer); the graph is at
  the ATen level.

Example:
    >>> traced = ColoTracer().trace(model, {"x": torch.empty(4, 32, device="meta")})
    >>> print(traced.summary())
    >>> traced.total_flops, traced.param_bytes
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import fx
from torch._subclasses import FakeTensorMode

from kolossos.auto_parallel.traced_graph import TracedGraph, TracingError, node_info

__all__ = ["ColoTracer", "TracingError"]

Backend = Literal["auto", "fx", "export"]


def _is_hf_model(module: torch.nn.Module) -> bool:
    return any(cls.__module__.startswith("transformers.") for cls in type(module).__mro__)


def _module_device(module: torch.nn.Module) -> torch.device:
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return torch.device("cpu")


def _fake_like(mode: FakeTensorMode, sample: Any, device: torch.device) -> Any:
    """A fake tensor with ``sample``'s shape and dtype on the module's device."""
    if not isinstance(sample, torch.Tensor):
        return sample
    with mode:
        return torch.empty(sample.shape, dtype=sample.dtype, device=device)


class _ShapeInterpreter(fx.Interpreter):
    """Runs an fx graph on fake tensors, storing each output in ``node.meta["val"]``."""

    def run_node(self, n: fx.Node) -> Any:
        try:
            result = super().run_node(n)
        except Exception as exc:
            raise TracingError(
                f"shape propagation failed at node {n.name!r} (op {n.op}, operator "
                f"{_describe(n.target)}): {type(exc).__name__}: {exc}. This operator cannot run "
                "on meta/fake tensors (data-dependent output shape or a missing meta kernel); "
                "make it a leaf or remove it from the traced region."
            ) from exc
        n.meta["val"] = result
        return result


def _describe(target: Any) -> str:
    if isinstance(target, str):
        return repr(target)
    return getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)


class ColoTracer:
    """Trace a module into a :class:`TracedGraph` with per-node meta information.

    Args:
        backend: ``"fx"`` (``torch.fx.symbolic_trace``), ``"export"`` (``torch.export``,
            non-strict) or ``"auto"``: ``export`` for Hugging Face models, ``fx`` otherwise.

    Raises:
        ValueError: an unknown backend.
    """

    def __init__(self, backend: Backend = "auto") -> None:
        if backend not in ("auto", "fx", "export"):
            raise ValueError(f"backend={backend!r} must be 'auto', 'fx' or 'export'.")
        self.backend: Backend = backend

    def trace(
        self,
        root: torch.nn.Module,
        meta_args: Mapping[str, Any] | None = None,
    ) -> TracedGraph:
        """Trace ``root`` called with the keyword inputs ``meta_args`` (meta tensors allowed).

        Returns:
            The graph module with ``meta["val"]`` (a fake tensor) on every node and a
            :class:`NodeInfo` per node.

        Raises:
            TracingError: the model cannot be traced or a node cannot run on fake tensors; the
                message names the node and the operator.
        """
        meta_args = dict(meta_args or {})
        backend = self.backend
        if backend == "auto":
            backend = "export" if _is_hf_model(root) else "fx"
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        device = _module_device(root)
        fake = {k: _fake_like(mode, v, device) for k, v in meta_args.items()}
        # running the graph may update buffers in place (BatchNorm's num_batches_tracked): keep
        # the model as it was
        buffers = {name: buf.detach().clone() for name, buf in root.named_buffers()}
        try:
            if backend == "fx":
                gm = self._trace_fx(root, fake, mode)
            else:
                gm = self._trace_export(root, fake)
        finally:
            with torch.no_grad():
                for name, buf in root.named_buffers():
                    buf.copy_(buffers[name])
        infos = [node_info(node, gm) for node in gm.graph.nodes]
        param_bytes = sum(p.numel() * p.element_size() for p in root.parameters())
        return TracedGraph(graph_module=gm, nodes=infos, param_bytes=param_bytes, backend=backend)

    @staticmethod
    def _trace_fx(
        root: torch.nn.Module, fake: dict[str, Any], mode: FakeTensorMode
    ) -> fx.GraphModule:
        tracer = fx.Tracer()
        try:
            graph = tracer.trace(root)
        except Exception as exc:
            nodes = list(tracer.graph.nodes) if hasattr(tracer, "graph") else []
            last = (
                f" at node {nodes[-1].name!r} (operator {_describe(nodes[-1].target)})"
                if nodes
                else ""
            )
            raise TracingError(
                f"torch.fx cannot trace {type(root).__name__}{last}: {type(exc).__name__}: {exc}. "
                "Data-dependent Python control flow is not traceable; try "
                "ColoTracer(backend='export') or move that logic out of forward."
            ) from exc
        gm = fx.GraphModule(root, graph)
        placeholders = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
        unknown = sorted(set(fake) - set(placeholders))
        if unknown:
            raise TracingError(
                f"meta_args names {unknown} are not inputs of {type(root).__name__}.forward "
                f"(its inputs: {placeholders}); pass them by their parameter names."
            )
        args = [fake.get(str(name)) for name in placeholders]
        with mode:
            _ShapeInterpreter(gm).run(*args)
        return gm

    @staticmethod
    def _trace_export(root: torch.nn.Module, fake: dict[str, Any]) -> fx.GraphModule:
        try:
            exported = torch.export.export(root, (), kwargs=fake, strict=False)
        except Exception as exc:
            raise TracingError(
                f"torch.export cannot trace {type(root).__name__}: {type(exc).__name__}: "
                f"{str(exc)[:2000]}"
            ) from exc
        return exported.graph_module
