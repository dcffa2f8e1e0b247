"""Rewrite an exported ATen graph so that each node runs its operator's strategy on this
rank's part of the tensors (the core of :mod:`~kolossos.auto_parallel.apply_graph`; how
parameters and buffers are stored is :mod:`~kolossos.auto_parallel.graph_params`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from kolossos.auto_parallel import graph_comm
from kolossos.auto_parallel.graph_comm import Kind
from kolossos.auto_parallel.graph_params import (
    ParamSpec,
    ParamUse,
    buffer_dim,
    param_use,
    split_chunks,
    store_parameters,
)
from kolossos.auto_parallel.module_graph import OperatorGroup
from kolossos.auto_parallel.shard_dims import (
    as_int,
    base_name,
    feature_source,
    node_shape,
    propagate_dims,
    sequence_sources,
)
from kolossos.auto_parallel.strategies import Strategy, UnsupportedOperatorError

__all__ = ["GraphRewriter", "ParamSpec"]

_SHAPED = {"view", "_unsafe_view", "reshape", "expand"}
_FACTORIES = {"new_zeros", "new_ones", "new_full", "new_empty", "zeros", "ones", "full",
              "empty", "arange", "randn", "rand"}  # fmt: skip
_LOSSES = {"cross_entropy_loss"}


def _bind(fn: Callable[..., Any], **fixed: Any) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        return fn(*args, **fixed)

    call.__name__ = fn.__name__
    return call


class GraphRewriter:
    """Builds the local graph of one rank for a plan (one :class:`Strategy` per operator)."""

    def __init__(
        self,
        program: torch.export.ExportedProgram,
        groups: list[OperatorGroup],
        strategies: Mapping[str, Strategy],
        model: nn.Module,
        world: int,
        rank: int,
        group: dist.ProcessGroup,
    ) -> None:
        self.program = program
        self.old = program.graph_module.graph
        self.groups = {g.name: g for g in groups}
        self.strategies = strategies
        self.model = model
        self.world, self.rank, self.group = world, rank, group
        self.owner: dict[str, str] = {}
        for g in groups:
            if g.kind == "input":
                self.owner[g.name] = g.name
            for name in g.nodes:
                self.owner[name] = g.name
        sig = program.graph_signature
        self.param_of = dict(sig.inputs_to_parameters)
        self.buffer_of = dict(sig.inputs_to_buffers)
        self.constant_of = dict(sig.inputs_to_lifted_tensor_constants)
        nodes = {n.name: n for n in self.old.nodes}
        self.nodes = nodes
        inputs = [g.name for g in groups if g.kind == "input"]
        batch = {(node_shape(nodes[i]) or (0,))[0] for i in inputs if node_shape(nodes[i])}
        self.batch = max(batch) if batch else 0
        sources_b: dict[str, int | None] = {
            i: 0 if (node_shape(nodes[i]) or (0,))[0] == self.batch else None for i in inputs
        }
        for n in self.old.nodes:  # ViT's CLS token expanded over the batch
            src = n.args[0] if n.args else None
            if (base_name(n) == "expand" and self.owner.get(n.name) in self.groups
                    and self.groups[self.owner[n.name]].kind == "token_params"
                    and (node_shape(n) or (0,))[0] == self.batch
                    and (node_shape(src) or (0,))[0] == 1):  # fmt: skip
                sources_b[n.name] = 0
        sources_f = {n.name: feature_source(n, self.param_of) for n in self.old.nodes}
        self.dims = {
            "B": propagate_dims(self.old, sources_b),
            "F": propagate_dims(self.old, {k: d for k, d in sources_f.items() if d is not None}),
            "Q": propagate_dims(self.old, sequence_sources(self.old, inputs)),
        }
        self.new = fx.Graph()
        self.env: dict[str, fx.Node] = {}
        self.converted: dict[tuple[str, Kind, int | None], fx.Node] = {}
        self.canonical = {id(p): n for n, p in model.named_parameters()}

    # ---- layouts -------------------------------------------------------------------------
    def batch_dim(self, name: str) -> int | None:
        """The batch dimension of node ``name``'s output, ``None`` if it has none."""
        return self.dims["B"].get(name)

    def _layout(self, group: str) -> str:
        return self.strategies[group].out_layout

    def _kind(self, layout: str, name: str) -> tuple[Kind, int | None]:
        if layout == "R":
            return "R", None
        dim = self.dims[layout].get(name)
        return ("S", dim) if dim is not None else ("P", None)

    # ---- parameters ----------------------------------------------------------------------
    def _param_name(self, placeholder: str) -> str:
        param = self.model.get_parameter(self.param_of[placeholder])
        return self.canonical[id(param)]

    def _use(self, group: OperatorGroup, node: fx.Node, placeholder: str) -> ParamUse:
        return param_use(group, self.strategies[group.name], node, placeholder,
                         lambda: split_chunks(group, self.nodes, self.dims["F"]))  # fmt: skip

    def _collect_uses(self) -> dict[str, set[ParamUse]]:
        uses: dict[str, set[ParamUse]] = {}
        for node in self.old.nodes:
            if node.op != "call_function" or node.name not in self.owner:
                continue
            group = self.groups[self.owner[node.name]]
            for a in node.all_input_nodes:
                if a.name in self.param_of:
                    uses.setdefault(self._param_name(a.name), set()).add(
                        self._use(group, node, a.name)
                    )
        return uses

    # ---- the rewrite ---------------------------------------------------------------------
    def rewrite(
        self,
    ) -> tuple[fx.Graph, dict[str, torch.Tensor], dict[str, ParamSpec], dict[str, torch.Tensor]]:
        """The local graph, its parameters (by attribute), their specs (by original name)
        and its constant tensors (by attribute)."""
        uses = self._collect_uses()
        params, self.specs = store_parameters(self.model, uses, self.rank, self.world)
        self.uses = uses
        self.buffer_specs: dict[str, ParamSpec] = {}
        self.buffer_nodes: dict[str, fx.Node] = {}
        self.param_nodes: dict[tuple[str, ParamUse], fx.Node] = {}
        constants: dict[str, torch.Tensor] = {}
        for node in self.old.nodes:
            if node.op == "placeholder":
                self._placeholder(node, constants)
            elif node.op == "call_function":
                if base_name(node) == "_assert_tensor_metadata":
                    continue
                self._call(node)
            elif node.op == "output":
                self._output(node)
        self.new.lint()
        return self.new, params, self.specs, constants

    def _placeholder(self, node: fx.Node, constants: dict[str, torch.Tensor]) -> None:
        if node.name in self.param_of:
            return
        tensor = None
        attr = f"const{len(constants)}"
        if node.name in self.buffer_of:
            name = self.buffer_of[node.name]
            tensor = self.model.get_buffer(name)
            dim = self._buffer_dim(node)
            if dim is not None:  # a feature-sharded BatchNorm's running statistics
                tensor = graph_comm.shard_of(tensor.detach(), dim, 1, self.rank, self.world)
                tensor = tensor.clone()
            self.buffer_specs[name] = ParamSpec(attr, dim)
        elif node.name in self.constant_of:
            found = self.program.constants[self.constant_of[node.name]]
            if not isinstance(found, torch.Tensor):
                raise UnsupportedOperatorError(
                    f"input {node.name!r} is a lifted {type(found).__name__}, not a tensor."
                )
            tensor = found
        if tensor is not None:
            constants[attr] = tensor
            self.env[node.name] = self.new.get_attr(attr)
            if node.name in self.buffer_of:
                self.buffer_nodes[self.buffer_of[node.name]] = self.env[node.name]
        else:
            self.env[node.name] = self.new.placeholder(node.name)

    def _buffer_dim(self, node: fx.Node) -> int | None:
        def reader(user: fx.Node) -> OperatorGroup | None:
            name = self.owner.get(user.name)
            return self.groups[name] if name is not None else None

        return buffer_dim(node, reader, self._layout)

    def _output(self, node: fx.Node) -> None:
        """The user outputs; the buffer mutations ``torch.export`` lists as extra outputs
        (running statistics of a functionalised BatchNorm) are written back instead."""
        from torch.export.graph_signature import OutputKind

        values = node.args[0]
        assert isinstance(values, list | tuple)
        specs = self.program.graph_signature.output_specs
        user = []
        for spec, value in zip(specs, values, strict=True):
            new = fx.map_arg(value, lambda a: self.env[a.name])
            if spec.kind == OutputKind.BUFFER_MUTATION:
                assert spec.target is not None
                target = self.buffer_nodes[spec.target]
                self.new.call_function(graph_comm.write_back, (target, new))
            elif spec.kind == OutputKind.USER_OUTPUT:
                user.append(new)
            else:
                raise UnsupportedOperatorError(
                    f"output {value} is a {spec.kind.name} output; the graph executor runs "
                    "graphs whose outputs are user outputs and buffer mutations."
                )
        self.new.output(tuple(user))

    def _param(self, placeholder: str, use: ParamUse) -> fx.Node:
        name = self._param_name(placeholder)
        key = (name, use)
        if key not in self.param_nodes:
            spec = self.specs[name]
            value = self.new.get_attr(spec.attr)
            if spec.dim is None and use.kind == "S":
                value = self.new.call_function(
                    graph_comm.shard_of, (value, use.dim, use.chunks, self.rank, self.world)
                )
            elif spec.summed and use.kind == "R":
                value = self.new.call_function(graph_comm.scale_grad, (value, 1.0 / self.world))
            self.param_nodes[key] = value
        return self.param_nodes[key]

    def _edge(self, src: fx.Node, dst_kind: Kind, dst_dim: int | None) -> fx.Node:
        """``src`` (owned by another operator or an input) in the kind the reader needs."""
        kind, dim = self._kind(self._layout(self.owner[src.name]), src.name)
        if (kind, dim) == (dst_kind, dst_dim):
            return self.env[src.name]
        key = (src.name, dst_kind, dst_dim)
        if key not in self.converted:
            shape = node_shape(src)
            for d in (dim, dst_dim):
                if d is not None and shape is not None and shape[d] % self.world:
                    raise UnsupportedOperatorError(
                        f"tensor {src.name!r} of shape {shape} cannot be split {self.world} "
                        f"ways along dimension {d}; pick sizes divisible by the mesh."
                    )
            self.converted[key] = self.new.call_function(
                _bind(graph_comm.relayout, group=self.group),
                (self.env[src.name], kind, dim, dst_kind, dst_dim),
            )
        return self.converted[key]

    @staticmethod
    def _aligned_dim(a: fx.Node, node: fx.Node, out_dim: int) -> int | None:
        """The dimension of ``a`` that spans ``node``'s sharded output dimension when the two
        are aligned on the right (broadcasting), at the full size; ``None`` if it broadcasts."""
        shape, out = node_shape(a), node_shape(node)
        if shape is None or out is None:
            return None
        d = out_dim - (len(out) - len(shape))
        return d if 0 <= d < len(shape) and shape[d] == out[out_dim] > 1 else None

    def _constant(self, a: fx.Node, node: fx.Node, layout: str, out_dim: int | None) -> fx.Node:
        """A constant (a mask built from positions) read by a sharded node: its slice where it
        spans the node's sharded dimension, the whole where it broadcasts."""
        value = self.env[a.name]
        d = None if layout == "R" or out_dim is None else self._aligned_dim(a, node, out_dim)
        if d is not None:
            key: tuple[str, Kind, int | None] = (a.name, "S", d)
            if key not in self.converted:
                self.converted[key] = self.new.call_function(
                    _bind(graph_comm.constant_part, group=self.group), (value, d)
                )
            return self.converted[key]
        return value

    def _localize(self, node: fx.Node, args: tuple[Any, ...], layout: str,
                  out_dim: int | None) -> tuple[Any, ...]:  # fmt: skip
        """``args`` with the sizes written on the sharded dimension divided by the mesh."""
        base = base_name(node)
        if base in _SHAPED and out_dim is not None:
            shape = list(args[1])
            size = shape[out_dim]
            if isinstance(size, int) and size != -1:
                self._divisible(node, size)
                shape[out_dim] = size // self.world
            return (args[0], shape, *args[2:])
        if base in ("split", "split_with_sizes") and layout != "R":
            src = node.args[0]
            assert isinstance(src, fx.Node)
            rank = len(node_shape(src) or (0,))
            split_dim = as_int(node.args[2]) % rank if len(node.args) > 2 else 0
            if self.dims[layout].get(src.name) == split_dim:
                sizes = args[1]
                for s in sizes if isinstance(sizes, list | tuple) else [sizes]:
                    self._divisible(node, int(s))
                local = (
                    [int(s) // self.world for s in sizes]
                    if isinstance(sizes, list | tuple)
                    else int(sizes) // self.world
                )
                return (args[0], local, *args[2:])
        return args

    def _divisible(self, node: fx.Node, size: int) -> None:
        if size % self.world:
            raise UnsupportedOperatorError(
                f"node {node.name!r} ({node.target}) has size {size} on its sharded dimension, "
                f"not divisible by the {self.world} ranks; pick sizes divisible by the mesh."
            )

    def _call(self, node: fx.Node) -> None:
        gname = self.owner.get(node.name)
        if gname is None:  # a constant: positions, masks
            self.env[node.name] = self.new.node_copy(node, lambda a: self.env[a.name])
            return
        group, strategy = self.groups[gname], self.strategies[gname]
        layout, role, base = strategy.out_layout, strategy.name, base_name(node)
        out_dim = self.dims[layout].get(node.name) if layout != "R" else None
        matmul = group.kind in ("linear", "embedding", "conv") and any(
            a.name in self.param_of for a in node.all_input_nodes
        )

        def arg(a: fx.Node) -> fx.Node:
            if a.name in self.param_of:
                return self._param(a.name, self._use(group, node, a.name))
            src = self.owner.get(a.name)
            if src == gname:
                return self.env[a.name]
            if src is None:
                return self._constant(a, node, layout, out_dim)
            want = strategy.input_layout(group.inputs.index(src))
            if want == "R" and role == "col" and matmul:
                return self._edge(a, "P", None)  # Megatron's f: all-reduce in backward
            kind, dim = self._kind(want, a.name)
            if kind == "P" and out_dim is not None:
                dim = self._aligned_dim(a, node, out_dim)  # a position embedding under Q
                kind = "S" if dim is not None else "P"
            return self._edge(a, kind, dim)

        shape = node_shape(node)
        if out_dim is not None and shape is not None:
            self._divisible(node, shape[out_dim])  # e.g. 3 heads over 2 ranks
        args = fx.map_arg(node.args, arg)
        kwargs = fx.map_arg(node.kwargs, arg)
        assert isinstance(args, tuple) and isinstance(kwargs, dict)
        if layout != "R" and base not in _LOSSES and out_dim is None:
            sharded = [
                a.name
                for a in node.all_input_nodes
                if self.owner.get(a.name) == gname and self.dims[layout].get(a.name) is not None
            ]
            if sharded or base in _FACTORIES:
                raise UnsupportedOperatorError(
                    f"node {node.name!r} ({node.target}) of operator {gname!r} under layout "
                    f"{layout} reduces, slices or creates along the sharded dimension of "
                    f"{sharded or 'a new tensor'}; this plan cannot run (choose another layout "
                    "for the operator)."
                )
        out: fx.Node
        if matmul and role == "row":
            if base == "addmm":
                out = self._fn(graph_comm.row_matmul, args[1], args[2], args[0], True)
            else:
                bias = args[2] if len(args) > 2 else None
                out = self._fn(graph_comm.row_matmul, args[0], args[1], bias, False)
        elif matmul and role == "vocab":
            padding = args[2] if len(args) > 2 else -1
            out = self._fn(graph_comm.vocab_embedding, args[0], args[1], padding)
        elif base == "batch_norm" and layout == "B" and self.world > 1:
            out = self._fn(graph_comm.sync_batch_norm, *args)  # the whole batch's statistics
        elif "batch_norm" in base and layout == "B" and self.world > 1:
            raise UnsupportedOperatorError(
                f"node {node.name!r} ({node.target}) of operator {gname!r}: a batch-sharded "
                "BatchNorm runs as aten.batch_norm (synchronised statistics) only; export the "
                "model without decompositions."
            )
        elif base == "scaled_dot_product_attention" and layout == "Q" and self.world > 1:
            out = self._sequence_attention(node, args, kwargs)
        elif base in _LOSSES and role in ("B", "F"):
            fn = graph_comm.batch_cross_entropy if role == "B" else graph_comm.vocab_cross_entropy
            rest = list(args[2:]) + [None, 1, -100, 0.0][len(args) - 2 :]
            out = self._fn(fn, args[0], args[1], *rest[:4])
        else:
            args = self._localize(node, args, layout, out_dim)
            out = self.new.call_function(node.target, args, kwargs)  # type: ignore[arg-type]
        self.env[node.name] = out

    def _sequence_attention(
        self, node: fx.Node, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> fx.Node:
        """Attention of this rank's queries (a part of the sequence) over every key: keys and
        values all-gathered along the sequence (their gradients reduce-scattered back); an
        explicit mask is sliced to the rank's query rows like any constant."""
        is_causal = args[5] if len(args) > 5 else kwargs.get("is_causal", False)
        if is_causal:
            raise UnsupportedOperatorError(
                f"node {node.name!r} ({node.target}) uses is_causal=True, which aligns the mask "
                "to the first query; a sequence-sharded attention needs an explicit mask."
            )
        keys, values = node.args[1], node.args[2]
        assert isinstance(keys, fx.Node) and isinstance(values, fx.Node)
        k_dim, v_dim = self.dims["Q"].get(keys.name), self.dims["Q"].get(values.name)
        if k_dim is None or v_dim is None:
            raise UnsupportedOperatorError(
                f"node {node.name!r}: keys or values without a sequence dimension under Q."
            )
        k = self._fn(graph_comm.gather_sequence, args[1], k_dim)
        v = self._fn(graph_comm.gather_sequence, args[2], v_dim)
        call_args = (args[0], k, v, *args[3:])
        return self.new.call_function(node.target, call_args, kwargs)  # type: ignore[arg-type]

    def _fn(self, fn: Callable[..., Any], *args: Any) -> fx.Node:
        return self.new.call_function(_bind(fn, group=self.group), args)
