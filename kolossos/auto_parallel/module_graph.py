"""Group an ATen graph from :class:`~kolossos.auto_parallel.ColoTracer` (``torch.export``) into
the operator DAG the sharding solver works on.

The ATen graph of a transformer has hundreds of nodes, most of them views. They are grouped
into *operators*, walking the graph in order:

* a node that reads a parameter belongs to the operator of its module (``transformer.h.0.attn.
  c_attn``, a ``Conv1D``; ``transformer.h.0.ln_1``; ``transformer.wte``). Its kind comes from the
  module type: linear (``nn.Linear``, Hugging Face ``Conv1D``), conv (``nn.Conv1d/2d/3d``; the
  patch embedding's ``flatten``/``transpose`` join it as views), layernorm (``LayerNorm`` or
  ``RMSNorm``), batchnorm (``nn.BatchNorm1d/2d/3d``), embedding; a module's own bare
  parameters that are only expanded, concatenated or added to activations (ViT's CLS token and
  position embeddings on ``ViTEmbeddings``) form a ``token_params`` operator;
* ``scaled_dot_product_attention`` starts an ``attention`` operator, ``cross_entropy_loss`` the
  ``loss`` (a sink);
* another node joins the operator of its input when it reads one operator, or the operator of
  its own module if that is among its inputs (the GELU's ``mul``/``tanh``); a node reading two
  operators is a residual ``add``; one in a new module (an activation) starts an
  ``elementwise`` operator (activations, and the per-channel pooling of a ResNet: max pool,
  average pool); views, dropout and dtype casts always join their input;
* each user input (``input_ids``, ``labels``) is an operator without inputs; nodes that depend
  on neither an input nor a parameter (position ranges, the causal mask) are constants, left out.

An operator's FLOPs are its nodes' sum, its activation bytes those its nodes' outputs keep alive
for backward (:mod:`~kolossos.auto_parallel.saved_activations`); an edge's bytes are those of the
nodes crossing it. :func:`build_module_graph` returns the groups and edges;
:mod:`~kolossos.auto_parallel.transformer_strategies` prices them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import fx, nn

from kolossos.auto_parallel.saved_activations import saved_activation_bytes
from kolossos.auto_parallel.shard_dims import propagate_dims, sequence_sources
from kolossos.auto_parallel.strategies import UnsupportedOperatorError
from kolossos.auto_parallel.traced_graph import TracedGraph
from kolossos.auto_parallel.tracer import ColoTracer

__all__ = ["GroupKind", "OperatorGroup", "build_module_graph"]

GroupKind = Literal[
    "input", "linear", "conv", "layernorm", "batchnorm", "embedding", "token_params",
    "attention", "elementwise", "add", "loss",
]  # fmt: skip

_VIEWS = {
    "view", "_unsafe_view", "reshape", "alias", "transpose", "permute", "expand", "split",
    "getitem", "t", "contiguous", "unsqueeze", "squeeze", "clone", "dropout", "to", "slice",
    "_to_copy", "select", "detach", "_assert_tensor_metadata", "pad", "flatten",
}  # fmt: skip
_ELEMENTWISE = {
    "mul", "add", "pow", "tanh", "gelu", "relu", "relu_", "silu", "sigmoid", "sub", "div",
    "max_pool2d", "max_pool2d_with_indices", "avg_pool2d", "adaptive_avg_pool2d",
}  # fmt: skip
_TOKEN_PARAM_OPS = {"expand", "cat", "add", "view", "_unsafe_view", "reshape", "slice"}
"""What a module may do with its own bare parameters to form a ``token_params`` operator
(ViT's ``cls_token.expand``, ``cat``, ``+ position_embeddings``)."""
_PARAM_KINDS = ("linear", "conv", "layernorm", "batchnorm", "embedding", "token_params")


@dataclass
class OperatorGroup:
    """One operator of the DAG: its ATen nodes, sizes and the operators it reads."""

    name: str
    kind: GroupKind
    path: str
    """Module path (``transformer.h.0.attn.c_attn``), or the input's name."""
    module_type: str = ""
    inputs: list[str] = field(default_factory=list)
    """Operators read, in order of first use."""
    in_bytes: dict[str, float] = field(default_factory=dict)
    """Bytes crossing from each input operator."""
    nodes: list[str] = field(default_factory=list)
    flops: float = 0.0
    act_bytes: float = 0.0
    """Bytes held from forward to backward (:func:`~kolossos.auto_parallel.saved_activations.
    saved_activation_bytes` of the group's nodes)."""
    param_bytes: float = 0.0
    bias_bytes: float = 0.0
    param_tensors: int = 0
    """Parameter tensors owned (weight, bias)."""
    ops: int = 0
    """ATen operators in the group, views included (each pays the dispatch cost)."""
    shared_bytes: float = 0.0
    """Bytes of parameters read here but owned by an earlier operator (a tied weight)."""
    seq_ok: bool = False
    """Every node keeps the sequence axis as its own dimension (no flatten of batch and
    sequence into rows, as GPT-2's ``Conv1D`` does): the operator may run sequence-sharded
    (layout ``Q``)."""
    tied_to: str = ""
    """The operator owning the shared weight (``transformer.wte`` for GPT-2's ``lm_head``)."""
    out_bytes: float = 0.0
    """Bytes of the group's last non-view node (what leaves it)."""
    op_bytes: float = 0.0
    """Output bytes of the group's non-view nodes that do no matmul FLOPs (elementwise,
    normalisation, softmax...): what memory-bound operators write, priced per byte."""


def _base(node: fx.Node) -> str:
    target = node.target
    name = getattr(target, "__name__", str(target))
    return name.split(".")[0]


def _module(node: fx.Node) -> tuple[str, str]:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "", ""
    path, kind = list(stack.values())[-1]
    type_name = kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))
    return str(path), type_name.rsplit(".", 1)[-1]


def _scope(node: fx.Node) -> str:
    """The module call of ``node``: ``torch.export`` keys a module's second call ``...@1``."""
    stack = node.meta.get("nn_module_stack") or {}
    return str(list(stack)[-1]) if stack else ""


def _kind_of(type_name: str, root: nn.Module, path: str, node: fx.Node) -> GroupKind:
    module = root.get_submodule(path) if path else None
    if isinstance(module, nn.Linear) or type_name == "Conv1D":
        return "linear"
    if isinstance(module, nn.Conv1d | nn.Conv2d | nn.Conv3d):
        return "conv"
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return "batchnorm"
    if isinstance(module, nn.LayerNorm | nn.RMSNorm) or type_name.endswith(
        ("LayerNorm", "RMSNorm")
    ):
        return "layernorm"  # a normalisation: LayerNorm, or RMSNorm (LLaMA), priced alike
    if isinstance(module, nn.Embedding) or type_name == "Embedding":
        return "embedding"
    if module is not None and _base(node) in _TOKEN_PARAM_OPS:
        own = {f"p_{path}_{n}".replace(".", "_") for n, _ in module.named_parameters(recurse=False)}
        if {a.name for a in node.all_input_nodes if a.name.startswith("p_")} <= own:
            return "token_params"  # ViT's CLS token / position embeddings
    raise UnsupportedOperatorError(
        f"autoparallelize has no sharding strategies for node {node.name!r} (operator "
        f"{node.target}) in module {path!r} ({type_name}); supported modules with parameters: "
        "nn.Linear / Conv1D, nn.Conv1d/2d/3d, nn.LayerNorm / RMSNorm, nn.BatchNorm1d/2d/3d, "
        "nn.Embedding, and a module's own parameters that are only expanded, concatenated or "
        "added to activations (a CLS token, position embeddings)."
    )


def build_module_graph(
    traced: TracedGraph, root: nn.Module, data_inputs: list[str]
) -> list[OperatorGroup]:
    """The operators of ``traced`` (an export-traced ``root``) in topological order.

    Args:
        data_inputs: names of the user inputs (batch tensors); other placeholders are parameters
            or buffers.

    Raises:
        UnsupportedOperatorError: a node outside the grouping rules (names node and operator).
    """
    graph = traced.graph_module.graph
    info = {i.name: i for i in traced.nodes}
    saved = saved_activation_bytes(traced)
    groups: dict[str, OperatorGroup] = {}
    owner: dict[str, str] = {}  # ATen node -> group
    params: dict[str, float] = {}
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        if node.name in data_inputs:
            groups[node.name] = OperatorGroup(
                name=node.name, kind="input", path=node.name, out_bytes=info[node.name].output_bytes
            )
            owner[node.name] = node.name
        elif node.name.startswith("p_"):  # torch.export's name for a parameter
            params[node.name] = float(info[node.name].output_bytes)
        # buffers (b_...) and constants (c_...) are neither activations nor parameters
    counted: dict[str, str] = {}  # parameter -> the operator owning it
    crossed: set[tuple[str, str]] = set()
    constant_to: dict[str, str] = {}  # (ATen node, group) edges already counted
    counter: dict[str, int] = {}
    called: dict[str, str] = {}  # module call -> its elementwise group (a reused ReLU: one each)

    def new_group(kind: GroupKind, path: str, type_name: str = "") -> OperatorGroup:
        base = path or kind
        index = counter.get(base, 0)
        counter[base] = index + 1
        name = base if index == 0 else f"{base}#{index}"
        groups[name] = OperatorGroup(name=name, kind=kind, path=path, module_type=type_name)
        return groups[name]

    for node in graph.nodes:
        if node.op != "call_function":
            continue
        live = [a.name for a in node.all_input_nodes if a.name in owner]
        read_params = [a.name for a in node.all_input_nodes if a.name in params]
        if not live and not read_params:
            continue  # a constant (positions, masks)
        path, type_name = _module(node)
        scope = _scope(node)
        base = _base(node)
        sources = list(dict.fromkeys(owner[a] for a in live))
        if read_params:
            key = path or node.name
            found = groups.get(key)
            if found is None:
                group = new_group(_kind_of(type_name, root, path, node), key, type_name)
            else:
                group = found
                if group.kind not in _PARAM_KINDS:
                    # the module's first nodes read no parameter (an RMSNorm's variance)
                    group.kind = _kind_of(type_name, root, path, node)
            for p in read_params:
                if p in counted and group.param_bytes == 0.0:
                    group.shared_bytes += params[p]  # tied to an earlier operator's weight
                    group.tied_to = counted[p]
                elif p not in counted:
                    counted[p] = group.name
                    group.param_bytes += params[p]
                    group.param_tensors += 1
                    if p.endswith("bias"):
                        group.bias_bytes += params[p]
        elif base == "scaled_dot_product_attention":
            group = new_group("attention", f"{path}.attention" if path else "attention")
        elif base in ("cross_entropy_loss", "nll_loss", "mse_loss"):
            group = new_group("loss", "loss")
        elif (
            scope in called
            and groups[called[scope]].kind == "elementwise"
            and sources
            and (base not in _VIEWS or called[scope] in sources)
        ):
            # more of an activation's (or LLaMA's rotary embedding's) nodes in the same call;
            # a view of another operator's output in the same module (attention's output
            # reshaped) is not one
            group = groups[called[scope]]
        elif len(sources) == 1 and (base in _VIEWS or groups[sources[0]].path == path):
            group = groups[sources[0]]
        elif path in sources:
            group = groups[path]
        elif base in _VIEWS and sources:
            group = groups[sources[-1]]
        elif len(sources) >= 2 and base in ("add", "mul"):
            group = new_group("add", f"{path}.add" if path else "add")
        elif len(sources) == 1 and base in _ELEMENTWISE:
            group = new_group("elementwise", path or base, type_name)
            called[scope] = group.name
        else:
            raise UnsupportedOperatorError(
                f"autoparallelize cannot group node {node.name!r} (operator {node.target}, "
                f"module {path!r}): it reads operators {sources}."
            )
        owner[node.name] = group.name
        group.nodes.append(node.name)
        for a in node.all_input_nodes:
            src = owner.get(a.name)
            if src is not None and src != group.name and (a.name, group.name) not in crossed:
                crossed.add((a.name, group.name))
                if src not in group.inputs:
                    group.inputs.append(src)
                    group.in_bytes[src] = 0.0
                group.in_bytes[src] += float(info[a.name].output_bytes)
        group.flops += float(info[node.name].flops)
        group.ops += 1
        group.act_bytes += saved.get(node.name, 0.0)
        if base not in _VIEWS:
            group.out_bytes = float(info[node.name].output_bytes)
            if not info[node.name].flops:
                group.op_bytes += float(info[node.name].output_bytes)
    # Constants (positions, the causal mask) are recomputed every step: their operators count
    # towards the operator that first reads them.
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and node.name not in owner:
            users = [owner.get(u.name) or constant_to.get(u.name) for u in node.users]
            target = next((u for u in users if u), None)
            if target is not None:
                constant_to[node.name] = target
                groups[target].ops += 1
    seq = propagate_dims(graph, sequence_sources(graph, data_inputs))
    for group in groups.values():
        shaped = [n for n in group.nodes if info[n].shapes]
        group.seq_ok = bool(shaped) and all(seq.get(n) is not None for n in shaped)
    ordered = list(groups.values())
    for group in ordered:
        if group.out_bytes == 0.0 and group.nodes:
            group.out_bytes = float(info[group.nodes[-1]].output_bytes)
    return ordered


def trace_operators(model: nn.Module, meta_inputs: dict[str, object]) -> list[OperatorGroup]:
    """Trace ``model`` (``torch.export`` on fake tensors) and group its operators.

    ``meta_inputs`` maps keyword names to meta tensors (the batch inputs, e.g. ``input_ids``
    and ``labels``) or to plain values passed through (``use_cache=False``).
    """
    traced = ColoTracer(backend="export").trace(model, meta_inputs)
    data = [k for k, v in meta_inputs.items() if isinstance(v, torch.Tensor)]
    return build_module_graph(traced, model, data)
