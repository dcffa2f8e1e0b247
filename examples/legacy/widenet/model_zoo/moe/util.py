"""Argument helpers of the MoE page: ``moe_mlp_args`` / ``moe_sa_args`` build the keyword
arguments of one expert FFN / one self-attention block, dropout modules included."""

from __future__ import annotations

from typing import Any

import torch.nn as nn


def moe_sa_args(
    d_model: int,
    n_heads: int,
    d_kv: int,
    attention_drop: float = 0.0,
    drop_rate: float = 0.0,
    bias: bool = True,
) -> dict[str, Any]:
    """The arguments of ``VanillaSelfAttention``."""
    return dict(
        d_model=d_model, n_heads=n_heads, d_kv=d_kv, bias=bias,
        dropout1=nn.Dropout(attention_drop), dropout2=nn.Dropout(drop_rate),
    )  # fmt: skip


def moe_mlp_args(d_model: int, d_ff: int, drop_rate: float, bias: bool = True) -> dict[str, Any]:
    """The arguments of ``VanillaFFN`` (one expert)."""
    return dict(
        d_model=d_model, d_ff=d_ff, bias=bias,
        dropout1=nn.Dropout(drop_rate), dropout2=nn.Dropout(drop_rate),
    )  # fmt: skip
