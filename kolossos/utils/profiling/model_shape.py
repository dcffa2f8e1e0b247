"""The shape of a transformer, read from a Hugging Face ``config.json`` or a kolossos model name,
for the memory planner (``kolossos plan``).

Only plain JSON is read (no ``transformers`` import): each supported ``model_type`` maps its
keys, with the defaults ``transformers`` uses when a key is missing, onto one
:class:`ModelShape`. The task model the shape describes is the one the planner assumes is trained:
``*ForCausalLM`` for decoders (gpt2, llama, mistral, qwen2, opt), ``BertForMaskedLM`` and
``ViTForImageClassification``.

Example:
    >>> shape = load_model_shape("gpt2-tiny")
    >>> shape.family, shape.num_layers, shape.hidden, shape.vocab
    ('gpt2', 2, 128, 2048)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "FAMILIES",
    "KNOWN_MODELS",
    "ModelShape",
    "load_model_shape",
    "shape_from_config",
]

#: supported ``model_type`` values -> the family whose layout they share
FAMILIES = {
    "gpt2": "gpt2",
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "opt": "opt",
    "bert": "bert",
    "vit": "vit",
}


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """Everything the planner needs to know about a model (sizes in elements)."""

    name: str
    """where it came from: a model name or a config path"""
    model_type: str
    """the config's ``model_type`` (``gpt2``, ``llama``, ``mistral``, ``qwen2``, ``opt``, ...)"""
    family: str
    """the layout family (:data:`FAMILIES`): ``gpt2``, ``llama``, ``opt``, ``bert`` or ``vit``"""
    num_layers: int
    """transformer blocks"""
    hidden: int
    """hidden size h"""
    heads: int
    """attention heads a"""
    kv_heads: int
    """key/value heads (grouped-query attention; ``heads`` otherwise)"""
    head_dim: int
    """dimensions per head"""
    intermediate: int
    """MLP width I"""
    vocab: int
    """vocabulary size V (ViT: the number of labels)"""
    max_positions: int
    """longest sequence (ViT: patches + 1)"""
    tied_embeddings: bool = True
    """the output head shares the input embedding's weight"""
    activation: str = "gelu"
    """the MLP's activation (decides which intermediates backward keeps)"""
    qkv_bias: bool = True
    """q/k/v projections have biases"""
    out_bias: bool = True
    """the attention output projection has a bias"""
    mlp_bias: bool = True
    """the MLP projections have biases"""
    norm_bias: bool = True
    """the norms have a bias (LayerNorm) or not (RMSNorm)"""
    hidden_dropout: float = 0.0
    """dropout on hidden states (a mask is kept per dropout site when > 0)"""
    attention_dropout: float = 0.0
    """dropout on attention probabilities"""
    embed_dim: int = 0
    """OPT's ``word_embed_proj_dim`` (0: ``hidden``)"""
    final_norm: bool = True
    """a norm after the last block"""
    type_vocab: int = 0
    """BERT's token-type vocabulary"""
    image_size: int = 0
    """ViT's image side"""
    patch_size: int = 0
    """ViT's patch side"""
    channels: int = 0
    """ViT's image channels"""

    @property
    def causal_lm(self) -> bool:
        """Whether the model is a decoder trained with the shifted next-token loss."""
        return self.family in ("gpt2", "llama", "opt")

    @property
    def default_seq_len(self) -> int:
        """The sequence length planned when none is given: the context, at most 2048 tokens
        (ViT: its patches and the class token)."""
        return self.max_positions if self.family == "vit" else min(self.max_positions, 2048)


# ---------------------------------------------------------------------------- reading configs
def _get(config: Mapping[str, Any], key: str, default: Any) -> Any:
    value = config.get(key, default)
    return default if value is None else value


def _int(config: Mapping[str, Any], key: str, default: int | None, *aliases: str) -> int:
    for name in (key, *aliases):
        if config.get(name) is not None:
            value = config[name]
            break
    else:
        if default is None:
            raise ValueError(f"config.json has no {key!r}; add it (an int >= 1).")
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"config.json: {key}={value!r} must be an int >= 1.")
    return value


def _float(config: Mapping[str, Any], key: str, default: float) -> float:
    value = _get(config, key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"config.json: {key}={value!r} must be a probability in [0, 1).")
    return float(value)


def _gpt2(c: Mapping[str, Any]) -> dict[str, Any]:
    h = _int(c, "n_embd", 768, "hidden_size")
    heads = _int(c, "n_head", 12, "num_attention_heads")
    return {
        "num_layers": _int(c, "n_layer", 12, "num_hidden_layers"),
        "hidden": h,
        "heads": heads,
        "kv_heads": heads,
        "head_dim": h // heads,
        "intermediate": _int(c, "n_inner", 4 * h),
        "vocab": _int(c, "vocab_size", 50257),
        "max_positions": _int(c, "n_positions", 1024, "max_position_embeddings"),
        "tied_embeddings": bool(_get(c, "tie_word_embeddings", True)),
        "activation": str(_get(c, "activation_function", "gelu_new")),
        "hidden_dropout": _float(c, "resid_pdrop", 0.1),
        "attention_dropout": _float(c, "attn_pdrop", 0.1),
    }


def _llama(c: Mapping[str, Any]) -> dict[str, Any]:
    kind = str(c.get("model_type"))
    defaults = {  # transformers' defaults per model_type
        "llama": (4096, 11008, 32, 32, None, 32000, 2048, False),
        "mistral": (4096, 14336, 32, 32, 8, 32000, 4096 * 32, False),
        "qwen2": (4096, 22016, 32, 32, 32, 151936, 32768, True),
    }[kind]
    h = _int(c, "hidden_size", defaults[0])
    heads = _int(c, "num_attention_heads", defaults[3])
    attention_bias = bool(_get(c, "attention_bias", False))
    return {
        "num_layers": _int(c, "num_hidden_layers", defaults[2]),
        "hidden": h,
        "heads": heads,
        "kv_heads": _int(c, "num_key_value_heads", defaults[4] or heads),
        "head_dim": _int(c, "head_dim", h // heads),
        "intermediate": _int(c, "intermediate_size", defaults[1]),
        "vocab": _int(c, "vocab_size", defaults[5]),
        "max_positions": _int(c, "max_position_embeddings", defaults[6]),
        "tied_embeddings": bool(_get(c, "tie_word_embeddings", False)),
        "activation": str(_get(c, "hidden_act", "silu")),
        "qkv_bias": defaults[7] or attention_bias,
        "out_bias": attention_bias,
        "mlp_bias": bool(_get(c, "mlp_bias", False)),
        "norm_bias": False,
        "attention_dropout": _float(c, "attention_dropout", 0.0),
    }


def _opt(c: Mapping[str, Any]) -> dict[str, Any]:
    h = _int(c, "hidden_size", 768)
    heads = _int(c, "num_attention_heads", 12)
    bias = bool(_get(c, "enable_bias", True))
    before = bool(_get(c, "do_layer_norm_before", True))
    if not before:
        raise ValueError(
            "config.json: do_layer_norm_before=false (OPT-350m's post-LN layout) is not "
            "modelled; only pre-LN OPT models are."
        )
    return {
        "num_layers": _int(c, "num_hidden_layers", 12),
        "hidden": h,
        "heads": heads,
        "kv_heads": heads,
        "head_dim": h // heads,
        "intermediate": _int(c, "ffn_dim", 3072),
        "vocab": _int(c, "vocab_size", 50272),
        "max_positions": _int(c, "max_position_embeddings", 2048),
        "tied_embeddings": bool(_get(c, "tie_word_embeddings", True)),
        "activation": str(_get(c, "activation_function", "relu")),
        "qkv_bias": bias,
        "out_bias": bias,
        "mlp_bias": bias,
        "norm_bias": bool(_get(c, "layer_norm_elementwise_affine", True)),
        "hidden_dropout": _float(c, "dropout", 0.1),
        "attention_dropout": _float(c, "attention_dropout", 0.0),
        "embed_dim": _int(c, "word_embed_proj_dim", h),
        "final_norm": not bool(_get(c, "_remove_final_layer_norm", False)),
    }


def _bert(c: Mapping[str, Any]) -> dict[str, Any]:
    h = _int(c, "hidden_size", 768)
    heads = _int(c, "num_attention_heads", 12)
    return {
        "num_layers": _int(c, "num_hidden_layers", 12),
        "hidden": h,
        "heads": heads,
        "kv_heads": heads,
        "head_dim": h // heads,
        "intermediate": _int(c, "intermediate_size", 3072),
        "vocab": _int(c, "vocab_size", 30522),
        "max_positions": _int(c, "max_position_embeddings", 512),
        "tied_embeddings": bool(_get(c, "tie_word_embeddings", True)),
        "activation": str(_get(c, "hidden_act", "gelu")),
        "hidden_dropout": _float(c, "hidden_dropout_prob", 0.1),
        "attention_dropout": _float(c, "attention_probs_dropout_prob", 0.1),
        "type_vocab": _int(c, "type_vocab_size", 2),
    }


def _vit(c: Mapping[str, Any]) -> dict[str, Any]:
    h = _int(c, "hidden_size", 768)
    heads = _int(c, "num_attention_heads", 12)
    image, patch = _int(c, "image_size", 224), _int(c, "patch_size", 16)
    labels = c.get("id2label")
    num_labels = len(labels) if isinstance(labels, dict) and labels else _int(c, "num_labels", 2)
    return {
        "num_layers": _int(c, "num_hidden_layers", 12),
        "hidden": h,
        "heads": heads,
        "kv_heads": heads,
        "head_dim": h // heads,
        "intermediate": _int(c, "intermediate_size", 3072),
        "vocab": num_labels,
        "max_positions": (image // patch) ** 2 + 1,
        "tied_embeddings": False,
        "activation": str(_get(c, "hidden_act", "gelu")),
        "qkv_bias": bool(_get(c, "qkv_bias", True)),
        "hidden_dropout": _float(c, "hidden_dropout_prob", 0.0),
        "attention_dropout": _float(c, "attention_probs_dropout_prob", 0.0),
        "image_size": image,
        "patch_size": patch,
        "channels": _int(c, "num_channels", 3),
    }


_READERS: dict[str, Callable[[Mapping[str, Any]], dict[str, Any]]] = {
    "gpt2": _gpt2,
    "llama": _llama,
    "opt": _opt,
    "bert": _bert,
    "vit": _vit,
}


def shape_from_config(config: Mapping[str, Any], name: str = "config.json") -> ModelShape:
    """The :class:`ModelShape` of a Hugging Face config (the parsed ``config.json``).

    Raises:
        ValueError: no or an unsupported ``model_type``, or a size that is not a positive int.

    Example:
        >>> shape_from_config({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        ...                    "num_hidden_layers": 2, "num_attention_heads": 4,
        ...                    "vocab_size": 100}).kv_heads
        4
    """
    if not isinstance(config, Mapping):
        raise ValueError(f"{name}: expected a JSON object, got {type(config).__name__}.")
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(
            f"{name}: model_type={model_type!r} is not supported; supported: "
            f"{', '.join(sorted(FAMILIES))}."
        )
    family = FAMILIES[model_type]
    fields = _READERS[family](config)
    shape = ModelShape(name=name, model_type=model_type, family=family, **fields)
    if shape.heads % shape.kv_heads:
        raise ValueError(
            f"{name}: num_attention_heads={shape.heads} is not a multiple of "
            f"num_key_value_heads={shape.kv_heads}."
        )
    if family in ("gpt2", "opt", "bert", "vit") and shape.hidden % shape.heads:
        raise ValueError(
            f"{name}: hidden size {shape.hidden} is not divisible by {shape.heads} heads."
        )
    return shape


# ---------------------------------------------------------------------------- named models
def _gpt2_named(layers: int, hidden: int, heads: int, vocab: int, seq: int) -> dict[str, Any]:
    """The benchmark GPT-2s (``benchmarks/models.py``): dropout off, context ``seq``."""
    return {
        "model_type": "gpt2", "n_layer": layers, "n_embd": hidden, "n_head": heads,
        "vocab_size": vocab, "n_positions": seq, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    }  # fmt: skip


#: model names ``kolossos plan --model`` accepts, as Hugging Face config dicts: the benchmark
#: models (``benchmarks/models.py``), the GPT-2 sizes and a few public configurations
KNOWN_MODELS: dict[str, dict[str, Any]] = {
    "gpt2-tiny": _gpt2_named(2, 128, 4, 2048, 64),
    "gpt2-30m": _gpt2_named(6, 384, 6, 50257, 128),
    "gpt2-50m": _gpt2_named(8, 512, 8, 50257, 128),
    "gpt2-120m": _gpt2_named(12, 768, 12, 50257, 128),
    "gpt2": {"model_type": "gpt2"},
    "gpt2-medium": {"model_type": "gpt2", "n_layer": 24, "n_embd": 1024, "n_head": 16},
    "gpt2-large": {"model_type": "gpt2", "n_layer": 36, "n_embd": 1280, "n_head": 20},
    "gpt2-xl": {"model_type": "gpt2", "n_layer": 48, "n_embd": 1600, "n_head": 25},
    "llama-2-7b": {"model_type": "llama", "max_position_embeddings": 4096},
    "llama-2-13b": {
        "model_type": "llama",
        "hidden_size": 5120,
        "intermediate_size": 13824,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "max_position_embeddings": 4096,
    },
    "llama-3-8b": {
        "model_type": "llama",
        "intermediate_size": 14336,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
    },
    "mistral-7b": {"model_type": "mistral"},
    "qwen2-7b": {
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
    },
    "opt-125m": {"model_type": "opt"},
    "opt-1.3b": {
        "model_type": "opt",
        "hidden_size": 2048,
        "ffn_dim": 8192,
        "num_hidden_layers": 24,
        "num_attention_heads": 32,
    },
    "bert-base": {"model_type": "bert"},
    "bert-large": {
        "model_type": "bert",
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
    },
    "vit-base": {"model_type": "vit", "num_labels": 1000},
}


def load_model_shape(spec: str) -> ModelShape:
    """The shape of ``spec``: a name in :data:`KNOWN_MODELS`, a ``config.json`` path, or a folder
    holding one.

    Raises:
        ValueError: an unknown name, an unreadable or invalid file, or an unsupported model.
    """
    if spec in KNOWN_MODELS:
        return shape_from_config(KNOWN_MODELS[spec], name=spec)
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    looks_like_path = path.suffix == ".json" or "/" in spec or path.exists()
    if not looks_like_path:
        raise ValueError(
            f"unknown model {spec!r}: give a Hugging Face config.json path or one of "
            f"{', '.join(KNOWN_MODELS)}."
        )
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}.") from None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}).") from None
    return shape_from_config(config, name=str(path))
