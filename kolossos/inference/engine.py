"""``InferenceEngine``: generation with a Hugging Face causal LM split over tensor-parallel
ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from kolossos.accelerator import get_accelerator
from kolossos.inference.cache import cache_keyword
from kolossos.inference.config import InferenceConfig
from kolossos.inference.decoding import DecodeRequest, decode
from kolossos.inference.groups import replica_groups
from kolossos.inference.inputs import check_prompts, check_same_prompts
from kolossos.inference.loading import load_causal_lm
from kolossos.inference.pipeline import PipelineStage, split_for_pipeline
from kolossos.inference.sampling import SamplingConfig
from kolossos.inference.sharding import (
    check_causal_lm,
    context_length,
    hf_config,
    shard_causal_lm,
)

__all__ = ["InferenceEngine"]


class InferenceEngine:
    """Generates text tokens with GPT-2, OPT or LLaMA, tensor-parallel over ``tp_size`` ranks,
    pipeline-parallel over ``pp_size`` stages (:mod:`kolossos.inference.pipeline`), or both
    (each stage tensor-parallel; ranks laid out as in :mod:`kolossos.inference.groups`).

    Every rank of a replica (``tp_size * pp_size`` ranks) builds the same engine and calls
    :meth:`generate` with the same inputs; every rank returns the same tokens.

    Args:
        model_or_path: a transformers ``GPT2LMHeadModel`` / ``OPTForCausalLM`` /
            ``LlamaForCausalLM`` with full weights (sharded in place), or a local folder
            written by ``save_pretrained``.
        inference_config: tensor-parallel and pipeline sizes, batch limit (default: one rank).

    Raises:
        ValueError: an unsupported model, ``tp_size * pp_size`` not dividing the world size,
            ``tp_size`` not dividing the model's heads, fewer blocks than stages.
        TypeError: arguments of the wrong type.
        RuntimeError: ``tp_size`` or ``pp_size`` above 1 without an initialised
            torch.distributed.
        FileNotFoundError: a path that is not a model folder.

    Example:
        >>> engine = InferenceEngine("./gpt2-folder", InferenceConfig(tp_size=2))  # doctest: +SKIP
        >>> out = engine.generate(ids, mask, SamplingConfig(max_new_tokens=8))  # doctest: +SKIP
    """

    def __init__(
        self, model_or_path: nn.Module | str | Path, inference_config: InferenceConfig | None = None
    ) -> None:
        config = inference_config if inference_config is not None else InferenceConfig()
        if not isinstance(config, InferenceConfig):
            raise TypeError(
                f"inference_config={config!r} must be a kolossos.inference.InferenceConfig."
            )
        if isinstance(model_or_path, str | Path):
            model = load_causal_lm(model_or_path)
        elif isinstance(model_or_path, nn.Module):
            model = model_or_path
        else:
            raise TypeError(
                f"model_or_path={model_or_path!r} must be a transformers causal LM or a folder."
            )
        check_causal_lm(model)
        self.config = config
        groups = replica_groups(config.tp_size, config.pp_size)
        self.tp_group: ProcessGroup | None = groups.replica
        """The group whose ranks compute one replica: every tensor-parallel rank of every
        pipeline stage (``None`` on one rank)."""
        self._token_source = groups.token_source
        self._cache_keyword = cache_keyword(model)
        model = model.to(get_accelerator().get_current_device()).eval()
        self._stage: PipelineStage | None = None
        if groups.tp is not None:  # shard first: the plans expect the whole model
            model = shard_causal_lm(model, groups.tp)
        if groups.pp is not None:
            self._stage = split_for_pipeline(model, groups.stage, config.pp_size)
            self._stage.group = groups.pp
        self.model = model

    @property
    def device(self) -> torch.device:
        """Where the model's weights, and the returned tokens, live."""
        return next(self.model.parameters()).device

    @property
    def decoder(self) -> nn.Module:
        """The module a decoding loop calls like the model: the model itself, or under pipeline
        parallelism this rank's :class:`~kolossos.inference.pipeline.PipelineStage` (all ranks
        of the replica must call it together, with inputs of the same shape)."""
        return self._stage if self._stage is not None else self.model

    @property
    def cache_keyword(self) -> str:
        """The model's KV cache argument name (``cache`` or ``past_key_values``)."""
        return self._cache_keyword

    def sync_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """Make ``tokens`` those of the replica's deciding rank (a broadcast; identity on one
        rank)."""
        return self._sync(tokens)

    def _sync(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tp_group is None:
            return tokens
        # sync point: one rank decides — the first tensor-parallel rank of the last stage, the
        # only stage with logits — so ranks never diverge, even if their logits differed in
        # the last bit
        dist.broadcast(tokens, src=self._token_source, group=self.tp_group)
        return tokens

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        sampling: SamplingConfig | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Continue each prompt of a left-padded batch.

        Args:
            input_ids: ``[batch, prompt_len]`` token ids, shorter prompts padded on the left.
            attention_mask: ``[batch, prompt_len]``, 0 on the padding and 1 on the prompt
                (``None``: no padding).
            sampling: greedy or sampling, lengths, cache (default: greedy, 32 tokens, cache on).
            generator: the sampling random source; ``None``: one seeded with
                ``sampling.seed`` when set, else torch's global generator.

        Returns:
            ``[batch, prompt_len + n]`` int64 on the model's device: prompts and ``n`` new
            tokens, as transformers' ``generate`` returns them.

        Raises:
            ValueError: bad shapes, right padding, a batch above ``max_batch_size``, prompt
                plus new tokens longer than the model's context, or different prompts on the
                ranks of the tensor-parallel group.
        """
        sampling = sampling if sampling is not None else SamplingConfig()
        if not isinstance(sampling, SamplingConfig):
            raise TypeError(f"sampling={sampling!r} must be a kolossos.inference.SamplingConfig.")
        ids, mask = check_prompts(
            input_ids,
            attention_mask,
            max_batch_size=self.config.max_batch_size,
            context=context_length(self.model),
            max_new_tokens=sampling.max_new_tokens,
        )
        if generator is None and sampling.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        ids, mask = ids.to(self.device), mask.to(self.device)
        if self.tp_group is not None:
            check_same_prompts(ids, mask, self.tp_group)
        request = self._request(ids, mask, sampling)
        return decode(
            self.decoder,
            request,
            sampling,
            cache_keyword=self._cache_keyword,
            sync=self._sync,
            generator=generator,
        )

    def _request(
        self, ids: torch.Tensor, mask: torch.Tensor, sampling: SamplingConfig
    ) -> DecodeRequest:
        model_config = hf_config(self.model)
        eos: Any = sampling.eos_token_id
        if eos is None:
            eos = model_config.eos_token_id  # an int, a list of ints, or None
        listed = eos if isinstance(eos, list | tuple) else [] if eos is None else [eos]
        eos_ids = tuple(int(e) for e in listed if e != -1)
        pad: Any = sampling.pad_token_id
        if pad is None:
            pad = model_config.pad_token_id
        if pad is None:
            pad = eos_ids[0] if eos_ids else 0
        return DecodeRequest(
            input_ids=ids,
            attention_mask=mask,
            eos_token_ids=eos_ids,
            pad_token_id=int(pad),
        )
