"""``enable_jit_fused``: the blocks' dropout + residual adds through one fused kernel
(:func:`kolossos.shardformer.layer.fused.dropout_add`).

A block (or BERT's output module) is given a subclass of its own class whose ``forward`` is the
transformers forward with ``residual + dropout(x)`` replaced by the fused call; everything else
(norms, attention, cache handling) is unchanged, and transformers' gradient checkpointing of the
layer still applies (the subclass is a ``GradientCheckpointingLayer`` too).

Per family: GPT-2 (``GPT2Block``: attention and MLP residuals; ``attn.resid_dropout`` and
``mlp.dropout`` become ``Identity`` and their rate moves to the block), OPT (``OPTDecoderLayer``:
both residuals), ViT (``ViTLayer``: both residuals), BERT (``BertSelfOutput`` and ``BertOutput``:
dropout + add before their LayerNorm). LLaMA has no bias and no dropout on its residual path
(``residual + o_proj(...)``), so nothing is fused there and its blocks stay as they are.

Activations: transformers' Python tanh-GELUs (``gelu_new``, GPT-2's default, and ``gelu_fast``:
eight or more element-wise kernels forward and more backward, each over the MLP's widest tensor)
become ``nn.GELU(approximate="tanh")``, the same function as one fused kernel each way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kolossos.shardformer.layer import fused
from kolossos.shardformer.policies._common import is_class

__all__ = ["FUSED_FAMILIES", "TANH_GELU_CLASSES", "apply_jit_fused", "fuse_activations"]

_P_ATTR = "_kolossos_dropout_p"
_classes: dict[tuple[type, str], type] = {}


def _swap(module: nn.Module, forward: Callable[..., Any]) -> None:
    """Give ``module`` a subclass of its class with ``forward`` (cached per class)."""
    cls = type(module)
    key = (cls, forward.__name__)
    if key not in _classes:
        doc = f"{cls.__name__} with its dropout + residual add fused (enable_jit_fused)."
        _classes[key] = type(f"JitFused{cls.__name__}", (cls,), {"forward": forward,
                                                                  "__doc__": doc})  # fmt: skip
    module.__class__ = _classes[key]


def _gpt2_block_forward(
    self: Any,
    hidden_states: torch.Tensor,
    cache: Any = None,
    attention_mask: torch.Tensor | None = None,
    encoder_hidden_states: torch.Tensor | None = None,
    encoder_attention_mask: torch.Tensor | None = None,
    use_cache: bool | None = False,
    **kwargs: Any,
) -> torch.Tensor:
    if encoder_hidden_states is not None:
        raise NotImplementedError(
            "enable_jit_fused with GPT-2 cross-attention (encoder_hidden_states) is not "
            "supported; leave enable_jit_fused=False."
        )
    p_attn, p_mlp = getattr(self, _P_ATTR)
    residual = hidden_states
    attn_output, _ = self.attn(
        self.ln_1(hidden_states),
        cache=cache,
        attention_mask=attention_mask,
        use_cache=use_cache,
        **kwargs,
    )
    hidden_states = fused.dropout_add(attn_output, residual, p_attn, self.training)
    residual = hidden_states
    feed_forward = self.mlp(self.ln_2(hidden_states))
    return fused.dropout_add(feed_forward, residual, p_mlp, self.training)


def _opt_layer_forward(
    self: Any,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    cache: Any = None,
    use_cache: bool | None = False,
    position_ids: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    residual = hidden_states
    if self.do_layer_norm_before:
        hidden_states = self.self_attn_layer_norm(hidden_states)
    hidden_states, _ = self.self_attn(
        hidden_states=hidden_states,
        cache=cache,
        position_ids=position_ids,
        attention_mask=attention_mask,
        **kwargs,
    )
    hidden_states = fused.dropout_add(hidden_states, residual, self.dropout, self.training)
    if not self.do_layer_norm_before:
        hidden_states = self.self_attn_layer_norm(hidden_states)
    shape = hidden_states.shape
    hidden_states = hidden_states.reshape(-1, hidden_states.size(-1))
    residual = hidden_states
    if self.do_layer_norm_before:
        hidden_states = self.final_layer_norm(hidden_states)
    hidden_states = self.fc2(self.activation_fn(self.fc1(hidden_states)))
    hidden_states = fused.dropout_add(hidden_states, residual, self.dropout, self.training)
    hidden_states = hidden_states.view(shape)
    if not self.do_layer_norm_before:
        hidden_states = self.final_layer_norm(hidden_states)
    return hidden_states


def _vit_layer_forward(
    self: Any,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    p = self.dropout.p
    residual = hidden_states
    hidden_states, _ = self.attention(self.layernorm_before(hidden_states), attention_mask,
                                      **kwargs)  # fmt: skip
    hidden_states = fused.dropout_add(hidden_states, residual, p, self.training)
    residual = hidden_states
    hidden_states = self.mlp(self.layernorm_after(hidden_states))
    return fused.dropout_add(hidden_states, residual, p, self.training)


def _bert_output_forward(
    self: Any, hidden_states: torch.Tensor, input_tensor: torch.Tensor
) -> torch.Tensor:
    hidden_states = self.dense(hidden_states)
    hidden_states = fused.dropout_add(hidden_states, input_tensor, self.dropout.p, self.training)
    return self.LayerNorm(hidden_states)


def _fuse_gpt2(block: Any) -> None:
    p = (float(block.attn.resid_dropout.p), float(block.mlp.dropout.p))
    block.attn.resid_dropout = nn.Identity()  # its dropout now runs in the block's fused add
    block.mlp.dropout = nn.Identity()
    setattr(block, _P_ATTR, p)
    _swap(block, _gpt2_block_forward)


def _fuse_bert(block: Any) -> None:
    _swap(block.attention.output, _bert_output_forward)
    _swap(block.output, _bert_output_forward)


FUSED_FAMILIES: dict[str, Callable[[Any], None] | None] = {
    "GPT2Block": _fuse_gpt2,
    "OPTDecoderLayer": lambda block: _swap(block, _opt_layer_forward),
    "ViTLayer": lambda block: _swap(block, _vit_layer_forward),
    "BertLayer": _fuse_bert,
    "LlamaDecoderLayer": None,  # no bias / dropout on the residual path: nothing to fuse
}
"""Block class → how its dropout + residual adds are fused (``None``: nothing to fuse)."""


#: transformers activation classes computing ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``
#: in several Python-level ops; ``nn.GELU(approximate="tanh")`` is that function, fused
TANH_GELU_CLASSES = ("NewGELUActivation", "FastGELUActivation")


def fuse_activations(module: nn.Module) -> int:
    """Replace every tanh-GELU written in Python (:data:`TANH_GELU_CLASSES`) under ``module``
    by ``nn.GELU(approximate="tanh")``. Returns how many were replaced."""
    replaced = 0
    for name, child in list(module.named_modules()):
        if name and type(child).__name__ in TANH_GELU_CLASSES:
            parent_name, _, attr = name.rpartition(".")
            parent = module.get_submodule(parent_name) if parent_name else module
            setattr(parent, attr, nn.GELU(approximate="tanh"))
            replaced += 1
    return replaced


def apply_jit_fused(blocks: nn.ModuleList) -> int:
    """Fuse the dropout + residual adds of every block in ``blocks`` and its Python tanh-GELUs
    (:func:`fuse_activations`), in place.

    Returns:
        The number of modules given a fused forward (activations not counted).

    Raises:
        NotImplementedError: a block class without a fused forward (a custom policy's model).
    """
    fused_modules = 0
    for block in blocks:
        name = next((n for n in FUSED_FAMILIES if is_class(block, n)), None)
        if name is None:
            raise NotImplementedError(
                f"enable_jit_fused=True: no fused dropout + add forward for "
                f"{type(block).__name__} (fused: {sorted(FUSED_FAMILIES)}); leave "
                "enable_jit_fused=False for this model."
            )
        fuse = FUSED_FAMILIES[name]
        fuse_activations(block)
        if fuse is not None:
            fuse(block)
            fused_modules += 2 if name == "BertLayer" else 1
    return fused_modules
