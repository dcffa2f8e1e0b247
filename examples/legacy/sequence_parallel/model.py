"""A small BERT (pre-LayerNorm, as Megatron's) whose self-attention is ring self-attention:
Colossal-AI's ``examples/tutorial/sequence_parallel/model`` in one file.

Each rank runs the model on its chunk of ``SEQ_LENGTH / P`` tokens: embeddings and MLPs are
per-token and need nothing from the other chunks; only ``TransformerSelfAttentionRing`` talks to
the other ranks of the sequence group (the keys and values travel around the ring).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from kolossos.legacy.nn.layer.parallel_sequence import TransformerSelfAttentionRing, sequence_group


def attention_mask_func(
    attention_scores: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """The tutorial's mask function: hidden positions get -10000."""
    return attention_scores.masked_fill(attention_mask, -10000.0)


class PreProcessor(nn.Module):
    """Global position ids of this rank's chunk, and the ``[b, 1, s/P, s]`` boolean attention
    mask (True = hidden: a padding query or key) from the whole ``[b, s]`` padding mask."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.group = group

    def forward(
        self, input_ids: torch.Tensor, padding_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        sub_seq = input_ids.shape[1]
        start = dist.get_rank(self.group) * sub_seq
        position_ids = torch.arange(start, start + sub_seq, device=input_ids.device)
        keep = padding_mask.bool()
        hidden = ~(keep[:, None, :] & keep[:, start : start + sub_seq, None])  # [b, s/P, s]
        return position_ids.expand_as(input_ids), hidden[:, None]

    def __deepcopy__(self, memo: dict[int, object]) -> PreProcessor:
        return PreProcessor(self.group)


class BertLayer(nn.Module):
    """Pre-LayerNorm transformer layer on ``[s/P, b, h]`` chunks."""

    def __init__(self, layer_number: int, hidden_size: int, num_attention_heads: int,
                 dropout: float, group: dist.ProcessGroup) -> None:  # fmt: skip
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden_size)
        self.self_attention = TransformerSelfAttentionRing(
            hidden_size=hidden_size,
            num_attention_heads=num_attention_heads,
            attention_dropout=dropout,
            attention_mask_func=attention_mask_func,
            layer_number=layer_number,
            apply_query_key_layer_scaling=True,
            group=group,
        )
        self.post_attention_layernorm = nn.LayerNorm(hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(hidden_size, 4 * hidden_size),
            nn.GELU(),
            nn.Linear(4 * hidden_size, hidden_size),
        )
        self.dropout = nn.Dropout(dropout)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        attention_output, attention_bias = self.self_attention(
            self.input_layernorm(hidden_states), attention_mask
        )
        hidden_states = hidden_states + self.dropout(attention_output + attention_bias)
        mlp_output = self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states + self.dropout(mlp_output)


class BertForPretrain(nn.Module):
    """Embeddings, ``num_layers`` ring-attention layers and the masked-LM head (tied to the word
    embeddings). ``forward(input_ids [b, s/P], padding_mask [b, s])`` → logits ``[b, s/P, V]``.

    Args:
        group: the sequence-parallel group (default: ``gpc``'s ``ParallelMode.SEQUENCE``).
    """

    def __init__(self, vocab_size: int, hidden_size: int, max_sequence_length: int,
                 num_attention_heads: int, num_layers: int, dropout: float = 0.1,
                 group: dist.ProcessGroup | None = None) -> None:  # fmt: skip
        super().__init__()
        group = sequence_group() if group is None else group
        if max_sequence_length % dist.get_world_size(group):
            raise ValueError(
                f"max_sequence_length={max_sequence_length} must be divisible by the "
                f"sequence-parallel size {dist.get_world_size(group)}."
            )
        self.preprocessor = PreProcessor(group)
        self.word_embeddings = nn.Embedding(vocab_size, hidden_size)
        self.position_embeddings = nn.Embedding(max_sequence_length, hidden_size)
        self.embedding_dropout = nn.Dropout(dropout)
        self.bert_layers = nn.ModuleList(
            BertLayer(i + 1, hidden_size, num_attention_heads, dropout, group)
            for i in range(num_layers)
        )
        self.layer_norm = nn.LayerNorm(hidden_size)
        self.lm_dense = nn.Linear(hidden_size, hidden_size)
        self.lm_layernorm = nn.LayerNorm(hidden_size)
        self.lm_bias = nn.Parameter(torch.zeros(vocab_size))
        for embedding in (self.word_embeddings, self.position_embeddings):
            nn.init.normal_(embedding.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        position_ids, attention_mask = self.preprocessor(input_ids, padding_mask)
        hidden = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        hidden = self.embedding_dropout(hidden).transpose(0, 1)  # [s/P, b, h]: Megatron's layout
        for layer in self.bert_layers:
            hidden = layer(hidden, attention_mask)
        hidden = self.layer_norm(hidden.transpose(0, 1))
        hidden = self.lm_layernorm(F.gelu(self.lm_dense(hidden)))
        return F.linear(hidden, self.word_embeddings.weight, self.lm_bias)
