"""Every parameter of a :class:`~kolossos.utils.profiling.model_shape.ModelShape`, in the order
``transformers`` registers it, with how tensor parallelism splits it.

The list is exact (it matches ``sum(p.numel() for p in model.parameters())`` of the task model
``transformers`` builds from the config, tied weights counted once), so the planner can also pack
Gemini's chunks, size ZeRO's buckets, find the largest tensor (the optimizer's temporaries) and
cut pipeline stages from it.

Example:
    >>> from kolossos.utils.profiling.model_shape import load_model_shape
    >>> count_parameters(load_model_shape("gpt2"))  # GPT2LMHeadModel, lm_head tied to wte
    124439808
"""

from __future__ import annotations

from dataclasses import dataclass

from kolossos.utils.profiling.model_shape import ModelShape

__all__ = [
    "ParamSpec",
    "count_parameters",
    "local_numel",
    "padded_vocab",
    "parameter_specs",
]

#: how tensor parallelism splits a parameter: ``col`` (output features), ``row`` (input
#: features; a bias stays whole), ``vocab`` (rows of a vocabulary, padded), ``rep`` (replicated)
TP_STYLES = ("col", "row", "vocab", "rep")


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor."""

    name: str
    """its name in the task model"""
    numel: int
    """elements"""
    segment: str
    """``embed`` (before the blocks), ``layer`` or ``head`` (after the blocks)"""
    layer: int = -1
    """the block index for ``layer`` parameters"""
    tp: str = "rep"
    """how tensor parallelism splits it (:data:`TP_STYLES`)"""
    rows: int = 0
    """``vocab`` style: the vocabulary rows (the rest of ``numel`` is rows x row size)"""


def padded_vocab(vocab: int, tp_size: int, divisible_by: int = 64) -> int:
    """The vocabulary of sharded embeddings and heads: ``vocab`` rounded up to a multiple of
    ``divisible_by * tp_size`` (``make_vocab_size_divisible_by``; only when ``tp_size > 1``)."""
    if tp_size <= 1:
        return vocab
    multiple = divisible_by * tp_size
    return -(-vocab // multiple) * multiple


def local_numel(spec: ParamSpec, tp_size: int, divisible_by: int = 64) -> int:
    """Elements of ``spec`` held by one tensor-parallel rank."""
    if tp_size <= 1 or spec.tp == "rep":
        return spec.numel
    if spec.tp == "vocab":
        width = spec.numel // spec.rows
        return padded_vocab(spec.rows, tp_size, divisible_by) // tp_size * width
    return spec.numel // tp_size


class _Builder:
    def __init__(self) -> None:
        self.specs: list[ParamSpec] = []
        self.segment, self.layer = "embed", -1

    def add(self, name: str, numel: int, tp: str = "rep", rows: int = 0) -> None:
        self.specs.append(ParamSpec(name, numel, self.segment, self.layer, tp, rows))

    def linear(self, name: str, out: int, inp: int, bias: bool, tp: str = "rep") -> None:
        self.add(f"{name}.weight", out * inp, tp)
        if bias:
            self.add(f"{name}.bias", out, "col" if tp == "col" else "rep")

    def norm(self, name: str, h: int, bias: bool = True) -> None:
        self.add(f"{name}.weight", h)
        if bias:
            self.add(f"{name}.bias", h)


def _gpt2(m: ModelShape, b: _Builder) -> None:
    h, inner = m.hidden, m.intermediate
    b.add("transformer.wte.weight", m.vocab * h, "vocab", m.vocab)
    b.add("transformer.wpe.weight", m.max_positions * h)
    for i in range(m.num_layers):
        b.segment, b.layer, p = "layer", i, f"transformer.h.{i}."
        b.norm(p + "ln_1", h)
        b.linear(p + "attn.c_attn", 3 * h, h, True, "col")
        b.linear(p + "attn.c_proj", h, h, True, "row")
        b.norm(p + "ln_2", h)
        b.linear(p + "mlp.c_fc", inner, h, True, "col")
        b.linear(p + "mlp.c_proj", h, inner, True, "row")
    b.segment, b.layer = "head", -1
    b.norm("transformer.ln_f", h)
    if not m.tied_embeddings:
        b.add("lm_head.weight", m.vocab * h, "vocab", m.vocab)


def _llama(m: ModelShape, b: _Builder) -> None:
    h, q, kv = m.hidden, m.heads * m.head_dim, m.kv_heads * m.head_dim
    b.add("model.embed_tokens.weight", m.vocab * h, "vocab", m.vocab)
    for i in range(m.num_layers):
        b.segment, b.layer, p = "layer", i, f"model.layers.{i}."
        b.linear(p + "self_attn.q_proj", q, h, m.qkv_bias, "col")
        b.linear(p + "self_attn.k_proj", kv, h, m.qkv_bias, "col")
        b.linear(p + "self_attn.v_proj", kv, h, m.qkv_bias, "col")
        b.linear(p + "self_attn.o_proj", h, q, m.out_bias, "row")
        b.linear(p + "mlp.gate_proj", m.intermediate, h, m.mlp_bias, "col")
        b.linear(p + "mlp.up_proj", m.intermediate, h, m.mlp_bias, "col")
        b.linear(p + "mlp.down_proj", h, m.intermediate, m.mlp_bias, "row")
        b.norm(p + "input_layernorm", h, bias=False)
        b.norm(p + "post_attention_layernorm", h, bias=False)
    b.segment, b.layer = "head", -1
    b.norm("model.norm", h, bias=False)
    if not m.tied_embeddings:
        b.add("lm_head.weight", m.vocab * h, "vocab", m.vocab)


def _opt(m: ModelShape, b: _Builder) -> None:
    h, e, p = m.hidden, m.embed_dim or m.hidden, "model.decoder."
    b.add(p + "embed_tokens.weight", m.vocab * e, "vocab", m.vocab)
    b.add(p + "embed_positions.weight", (m.max_positions + 2) * h)  # OPT's offset of 2
    if e != h:
        b.linear(p + "project_out", e, h, False)
        b.linear(p + "project_in", h, e, False)
    if m.final_norm:
        b.segment = "head"  # registered before the blocks, used after them
        b.norm(p + "final_layer_norm", h, m.norm_bias)
    for i in range(m.num_layers):
        b.segment, b.layer, q = "layer", i, f"{p}layers.{i}."
        for proj in ("k_proj", "v_proj", "q_proj"):
            b.linear(q + "self_attn." + proj, h, h, m.qkv_bias, "col")
        b.linear(q + "self_attn.out_proj", h, h, m.out_bias, "row")
        b.norm(q + "self_attn_layer_norm", h, m.norm_bias)
        b.linear(q + "fc1", m.intermediate, h, m.mlp_bias, "col")
        b.linear(q + "fc2", h, m.intermediate, m.mlp_bias, "row")
        b.norm(q + "final_layer_norm", h, m.norm_bias)
    b.segment, b.layer = "head", -1
    if not m.tied_embeddings:
        b.add("lm_head.weight", m.vocab * e, "vocab", m.vocab)


def _bert(m: ModelShape, b: _Builder) -> None:
    h, p = m.hidden, "bert.embeddings."
    b.add(p + "word_embeddings.weight", m.vocab * h, "vocab", m.vocab)
    b.add(p + "position_embeddings.weight", m.max_positions * h)
    b.add(p + "token_type_embeddings.weight", m.type_vocab * h)
    b.norm(p + "LayerNorm", h)
    for i in range(m.num_layers):
        b.segment, b.layer, q = "layer", i, f"bert.encoder.layer.{i}."
        for proj in ("query", "key", "value"):
            b.linear(q + "attention.self." + proj, h, h, True, "col")
        b.linear(q + "attention.output.dense", h, h, True, "row")
        b.norm(q + "attention.output.LayerNorm", h)
        b.linear(q + "intermediate.dense", m.intermediate, h, True, "col")
        b.linear(q + "output.dense", h, m.intermediate, True, "row")
        b.norm(q + "output.LayerNorm", h)
    b.segment, b.layer = "head", -1
    b.add("cls.predictions.bias", m.vocab, "vocab", m.vocab)
    b.linear("cls.predictions.transform.dense", h, h, True)
    b.norm("cls.predictions.transform.LayerNorm", h)
    if not m.tied_embeddings:
        b.add("cls.predictions.decoder.weight", m.vocab * h, "vocab", m.vocab)


def _vit(m: ModelShape, b: _Builder) -> None:
    h, p = m.hidden, "vit.embeddings."
    b.add(p + "cls_token", h)
    b.add(p + "position_embeddings", m.max_positions * h)
    b.linear(p + "patch_embeddings.projection", h, m.channels * m.patch_size**2, True)
    for i in range(m.num_layers):
        b.segment, b.layer, q = "layer", i, f"vit.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj"):
            b.linear(q + "attention." + proj, h, h, m.qkv_bias, "col")
        b.linear(q + "attention.o_proj", h, h, True, "row")
        b.norm(q + "layernorm_before", h)
        b.norm(q + "layernorm_after", h)
        b.linear(q + "mlp.fc1", m.intermediate, h, True, "col")
        b.linear(q + "mlp.fc2", h, m.intermediate, True, "row")
    b.segment, b.layer = "head", -1
    b.norm("vit.layernorm", h)
    b.linear("classifier", m.vocab, h, True)


_BUILDERS = {"gpt2": _gpt2, "llama": _llama, "opt": _opt, "bert": _bert, "vit": _vit}


def parameter_specs(shape: ModelShape) -> list[ParamSpec]:
    """The model's parameters in registration order, each tied tensor once."""
    builder = _Builder()
    _BUILDERS[shape.family](shape, builder)
    return builder.specs


def count_parameters(shape: ModelShape) -> int:
    """Ψ: the number of distinct parameter elements."""
    return sum(spec.numel for spec in parameter_specs(shape))
