"""Batches of requests decoded together: continuous batching (the default) and static buckets.

A :class:`DecodingBatch` holds the sequences being decoded and runs one decoding step at a time
for all of them. Between steps requests *join* (:meth:`DecodingBatch.add`) and finished or
cancelled ones *leave*, which is continuous batching. With ``keep_finished=True`` finished rows
stay in the batch (their tokens are no longer reported) until every row is done: a static batch,
Energon-AI's bucket batching.

Joining: at the step where requests join, the running rows take their usual one-token step and
the new rows are prefilled on their own (left-padded among themselves); the two key/value caches
are then merged: the shorter one is padded on the left with zeros that the attention mask hides,
and the rows are concatenated. A leave drops rows from the cache in place. Every row keeps the
position ids and the visible keys it would have alone, so greedy decoding gives each request the
tokens it gets from a batch of one. A cache whose layout is not the known per-layer ``keys`` /
``values`` tensors (:class:`_LayeredCache`) falls back to re-running the whole batch without a
cache at a join (same tokens, more work).

Which requests join when is decided elsewhere (:mod:`kolossos.inference.scheduler`); this module
only decodes, so every tensor-parallel rank can run it with the same joins and get the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch import nn

from kolossos.inference.decoding import TokenSync
from kolossos.inference.sampling import SamplingConfig, select_next_tokens

__all__ = [
    "BatchingConfig",
    "DecodingBatch",
    "GenerationRequest",
    "TokenEvent",
    "bucket_key",
]

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True, kw_only=True)
class BatchingConfig:
    """How the serving loop groups requests (Energon-AI's knob names where it has them).

    Example:
        >>> BatchingConfig(mode="static", executor_max_batch_size=16)
        BatchingConfig(mode='static', executor_max_batch_size=16, cache_size=50, cache_list_size=2)
    """

    mode: Literal["continuous", "static"] = "continuous"
    """``continuous``: requests join between decoding steps and leave when done (rows may mix
    sampling settings: each row samples with its own). ``static``: bucket batching as Energon-AI
    documents it: the FIFO queue's head and the consecutive requests after it with the same
    ``temperature``/``top_k``/``top_p`` and no more decoding steps than the head run together
    until all are done."""
    executor_max_batch_size: int = 8
    """The most requests decoded together."""
    cache_size: int = 50
    """Prompts whose results the LRU result cache keeps (0: no cache)."""
    cache_list_size: int = 2
    """Results kept per prompt; once that many are stored a random one is returned."""

    def __post_init__(self) -> None:
        if self.mode not in ("continuous", "static"):
            raise ValueError(f"BatchingConfig.mode={self.mode!r} must be 'continuous' or 'static'.")
        for name, low in (
            ("executor_max_batch_size", 1),
            ("cache_size", 0),
            ("cache_list_size", 1),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"BatchingConfig.{name}={value!r} must be an int >= {low}.")


@dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    """One prompt to continue, with its own sampling settings, length and EOS ids (picklable, so
    the serving loop can broadcast it to the other tensor-parallel ranks)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingConfig
    """``max_new_tokens``, greedy or sampling settings, ``seed`` (``use_cache`` is ignored)."""
    eos_token_ids: tuple[int, ...] = ()
    """The request stops at any of these (reported with finish reason ``stop``)."""


def bucket_key(request: GenerationRequest) -> tuple[Any, ...]:
    """The settings a static batch must share: sampling mode, temperature, top-k, top-p, EOS."""
    s = request.sampling
    return (s.do_sample, s.temperature, s.top_k or 0, s.top_p, request.eos_token_ids)


@dataclass(frozen=True)
class TokenEvent:
    """A token chosen for a request; ``finish_reason`` is set on its last one (``stop``: the
    token is an EOS, not part of the text; ``length``: ``max_new_tokens`` reached)."""

    request_id: str
    token: int
    finish_reason: FinishReason | None


@runtime_checkable
class _BatchSelectable(Protocol):
    def batch_select_indices(self, indices: torch.Tensor) -> None: ...


@runtime_checkable
class _KeyValueLayer(Protocol):
    keys: torch.Tensor
    values: torch.Tensor


@runtime_checkable
class _LayeredCache(Protocol):
    """transformers' ``DynamicCache``: one ``keys``/``values`` pair per layer,
    ``[batch, heads, positions, head_dim]``."""

    layers: list[Any]


def _pad_left(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _merge_caches(first: _LayeredCache, second: _LayeredCache, width: int) -> None:
    """Append ``second``'s rows to ``first`` in place, both left-padded to ``width`` positions."""
    for mine, theirs in zip(first.layers, second.layers, strict=True):
        if not (isinstance(mine, _KeyValueLayer) and isinstance(theirs, _KeyValueLayer)):
            raise TypeError(f"unknown cache layer {type(mine).__name__}")
        mine.keys = torch.cat([_pad_left(mine.keys, width, -2), _pad_left(theirs.keys, width, -2)])
        mine.values = torch.cat(
            [_pad_left(mine.values, width, -2), _pad_left(theirs.values, width, -2)]
        )


def _mergeable(cache: Any) -> bool:
    return isinstance(cache, _LayeredCache) and all(
        isinstance(layer, _KeyValueLayer) for layer in cache.layers
    )


@dataclass
class _Row:
    request: GenerationRequest
    tokens: list[int]
    generator: torch.Generator | None
    generated: int = 0
    done: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def _position_ids(mask: torch.Tensor) -> torch.Tensor:
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)


class DecodingBatch:
    """The rows being decoded, advanced one token per :meth:`step`.

    Args:
        model: a causal LM returning full-vocabulary logits (sharded or not).
        cache_keyword: its KV cache argument name (:func:`kolossos.inference.cache.cache_keyword`).
        sync: makes each step's tokens identical on all tensor-parallel ranks.
        pad_token_id: the left padding.
        keep_finished: static batching (finished rows stay until all are done).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        cache_keyword: str,
        sync: TokenSync,
        pad_token_id: int,
        keep_finished: bool = False,
    ) -> None:
        self.model = model
        self._keyword = cache_keyword
        self._sync = sync
        self._pad = pad_token_id
        self._keep_finished = keep_finished
        self._device = next(model.parameters()).device
        self._rows: list[_Row] = []
        self._cache: Any = None
        self._mask: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self._joining = 0  # rows added since the last step (the last rows of the batch)

    @property
    def running(self) -> int:
        """Rows still generating (finished rows kept by a static batch not counted)."""
        return sum(not row.done for row in self._rows)

    @property
    def request_ids(self) -> list[str]:
        """The requests still generating, in row order."""
        return [row.request.request_id for row in self._rows if not row.done]

    def add(self, requests: list[GenerationRequest]) -> None:
        """Join ``requests``; the next :meth:`step` prefills the batch with them."""
        for request in requests:
            seed = request.sampling.seed
            generator = None
            if seed is not None:
                generator = torch.Generator(device=self._device).manual_seed(seed)
            self._rows.append(_Row(request, list(request.prompt_ids), generator))
            self._joining += 1

    def cancel(self, request_ids: set[str]) -> None:
        """Drop the rows of ``request_ids`` (unknown ids are ignored)."""
        for row in self._rows:
            if row.request.request_id in request_ids:
                row.done = True
        self._leave()

    def _leave(self) -> None:
        if self._joining or (self._keep_finished and any(not row.done for row in self._rows)):
            return
        keep = [i for i, row in enumerate(self._rows) if not row.done]
        if len(keep) == len(self._rows):
            return
        self._rows = [self._rows[i] for i in keep]
        if not keep:
            self._cache = self._mask = self._positions = None
        elif isinstance(self._cache, _BatchSelectable) and self._mask is not None:
            index = torch.tensor(keep, device=self._device)
            self._cache.batch_select_indices(index)
            self._mask, self._positions = self._mask[index], _position_ids(self._mask[index])
        else:
            self._cache = None  # a cache without batch selection: prefill again

    def _prefill(self, rows: list[_Row]) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """Run ``rows``' tokens so far (left-padded) without a cache: ``(output, mask,
        positions)``."""
        width = max(len(row.tokens) for row in rows)
        ids = torch.full((len(rows), width), self._pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(rows):
            ids[i, width - len(row.tokens) :] = torch.tensor(row.tokens)
            mask[i, width - len(row.tokens) :] = 1
        mask = mask.to(self._device)
        positions = _position_ids(mask)
        output = self.model(
            input_ids=ids.to(self._device), attention_mask=mask, position_ids=positions,
            use_cache=True,
        )  # fmt: skip
        return output, mask, positions

    def _advance(self, rows: int) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """One token for the first ``rows`` rows with the cache: ``(output, mask, positions)``."""
        assert self._mask is not None and self._positions is not None
        last = torch.tensor([[row.tokens[-1]] for row in self._rows[:rows]], device=self._device)
        output = self.model(
            input_ids=last, attention_mask=self._mask, position_ids=self._positions[:, -1:],
            use_cache=True, **{self._keyword: self._cache},
        )  # fmt: skip
        return output, self._mask, self._positions

    def _forward(self) -> torch.Tensor:
        """The step's forward(s); the last-position logits of every row, cache and mask updated."""
        old = len(self._rows) - self._joining
        if self._cache is None or not old or (self._joining and not _mergeable(self._cache)):
            output, self._mask, self._positions = self._prefill(self._rows)
            self._cache = output[self._keyword]
            return output.logits[:, -1, :]
        running, mask, positions = self._advance(old)
        self._cache = running[self._keyword]
        if not self._joining:
            return running.logits[:, -1, :]
        joined, new_mask, new_positions = self._prefill(self._rows[old:])
        width = max(mask.shape[1], new_mask.shape[1])
        _merge_caches(self._cache, joined[self._keyword], width)
        self._mask = torch.cat([_pad_left(mask, width, 1), _pad_left(new_mask, width, 1)])
        self._positions = torch.cat(
            [_pad_left(positions, width, 1), _pad_left(new_positions, width, 1)]
        )
        return torch.cat([running.logits[:, -1, :], joined.logits[:, -1, :]])

    def _choose(self, logits: torch.Tensor) -> torch.Tensor:
        tokens = logits.argmax(dim=-1)
        for i, row in enumerate(self._rows):
            if row.request.sampling.do_sample and not row.done:
                chosen = select_next_tokens(logits[i : i + 1], row.request.sampling, row.generator)
                tokens[i] = chosen[0]
        return tokens

    @torch.no_grad()
    def step(self) -> list[TokenEvent]:
        """One decoding step for every row; the tokens chosen for the running requests."""
        if not self._rows:
            return []
        logits = self._forward()
        self._joining = 0
        assert self._mask is not None and self._positions is not None
        tokens = self._sync(self._choose(logits.float()))
        self._mask = torch.cat([self._mask, self._mask.new_ones(len(self._rows), 1)], dim=-1)
        self._positions = torch.cat([self._positions, self._positions[:, -1:] + 1], dim=-1)
        events: list[TokenEvent] = []
        for row, token in zip(self._rows, tokens.tolist(), strict=True):
            row.tokens.append(int(token))
            if row.done:
                continue
            row.generated += 1
            reason: FinishReason | None = None
            if token in row.request.eos_token_ids:
                reason = "stop"
            elif row.generated >= row.request.sampling.max_new_tokens:
                reason = "length"
            row.done = reason is not None
            events.append(TokenEvent(row.request.request_id, int(token), reason))
        self._leave()
        return events
