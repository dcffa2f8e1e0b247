"""Sequence parallelism: the sequence dimension split over the ranks of a process group.

* :mod:`~kolossos.sequence.ring_self_attention` — ring self-attention (RSA, arXiv 2105.13120):
  :class:`RingQK`, :class:`RingAV`, :class:`TransformerSelfAttentionRing`.
* :mod:`~kolossos.sequence.ulysses` — Ulysses all-to-all: :func:`seq_to_heads`,
  :func:`heads_to_seq`, :func:`ulysses_attention`.
* :mod:`~kolossos.sequence.ring_attention` — ring attention / context parallelism (online
  softmax, K/V round the ring): :func:`ring_attention`.
* :mod:`~kolossos.sequence.zigzag` — sequence layouts: :func:`zigzag_split`,
  :func:`zigzag_merge`, :func:`split_sequence`, :func:`sequence_positions`.
"""

from kolossos.sequence.ring_attention import ring_attention, ring_attention_comm_bytes
from kolossos.sequence.ring_self_attention import (
    AttnMaskType,
    RingAV,
    RingQK,
    TransformerSelfAttentionRing,
    ring_self_attention_bytes,
)
from kolossos.sequence.ulysses import (
    all_to_all,
    heads_to_seq,
    seq_to_heads,
    ulysses_attention,
    ulysses_comm_bytes,
)
from kolossos.sequence.zigzag import (
    sequence_positions,
    sequence_segments,
    split_sequence,
    zigzag_merge,
    zigzag_split,
)

__all__ = [
    "AttnMaskType",
    "RingAV",
    "RingQK",
    "TransformerSelfAttentionRing",
    "all_to_all",
    "heads_to_seq",
    "ring_attention",
    "ring_attention_comm_bytes",
    "ring_self_attention_bytes",
    "seq_to_heads",
    "sequence_positions",
    "sequence_segments",
    "split_sequence",
    "ulysses_attention",
    "ulysses_comm_bytes",
    "zigzag_merge",
    "zigzag_split",
]
