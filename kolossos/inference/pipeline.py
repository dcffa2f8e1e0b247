"""Pipeline-parallel generation: the decoder blocks split over consecutive stages.

Each stage keeps a contiguous run of the model's decoder blocks (renumbered from 0, so the
model's own ``DynamicCache`` holds only this stage's keys and values). Every step, the first
stage runs the token and position embeddings and its blocks on the new tokens, sends the hidden
states on (``send``/``recv``, shape ``[batch, new tokens, hidden]`` known on every stage), and the
last stage runs its blocks, the final norm and the LM head. The last stage's next tokens are then
broadcast to every stage (the engine's token sync). The stages call the model's own Hugging Face
forward (``inputs_embeds`` past the first stage), so positions, causal masks and rotary
embeddings are built exactly as ``generate`` builds them.

With tensor parallelism as well, the model is sharded before it is split, and each rank
exchanges hidden states with the rank of the same tensor-parallel index on the neighbouring
stages (the pipeline group of :mod:`kolossos.inference.groups`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

__all__ = ["PipelineStage", "split_for_pipeline"]


@dataclass(frozen=True, kw_only=True)
class _Family:
    base: tuple[str, ...]
    """Attribute path from the causal LM to the module that embeds and runs the blocks."""
    layers: str
    norm: str
    positions: str | None
    """Learned position embeddings (zeroed past the first stage: added there already)."""


_FAMILIES: dict[str, _Family] = {
    "GPT2LMHeadModel": _Family(base=("transformer",), layers="h", norm="ln_f", positions="wpe"),
    "OPTForCausalLM": _Family(
        base=("model", "decoder"),
        layers="layers",
        norm="final_layer_norm",
        positions="embed_positions",
    ),
    "LlamaForCausalLM": _Family(base=("model",), layers="layers", norm="norm", positions=None),
}


class _NoPositions(nn.Module):
    """Adds nothing: the hidden states a later stage receives already hold the positions."""

    def forward(self, ids_or_mask: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return ids_or_mask.new_zeros((), dtype=torch.float32)


def _module(model: nn.Module, path: tuple[str, ...]) -> nn.Module:
    for name in path:
        model = getattr(model, name)
    return model


def split_for_pipeline(model: nn.Module, stage: int, stages: int) -> PipelineStage:
    """Keep (in place) only this stage's decoder blocks of ``model`` and wrap it as a stage.

    Raises:
        ValueError: a model family without a pipeline split, an OPT with embedding projections,
            or fewer decoder blocks than stages.
    """
    family = _FAMILIES.get(type(model).__name__)
    if family is None:
        raise ValueError(
            f"pipeline-parallel generation supports {sorted(_FAMILIES)}, not "
            f"{type(model).__name__}; use pp_size=1."
        )
    base = _module(model, family.base)
    if getattr(base, "project_in", None) is not None or getattr(base, "project_out", None):
        raise ValueError(
            "pipeline-parallel generation needs OPT's word_embed_proj_dim == hidden_size (no "
            "project_in/project_out); use pp_size=1 for this model."
        )
    blocks: nn.ModuleList = getattr(base, family.layers)
    if len(blocks) < stages:
        raise ValueError(
            f"InferenceConfig(pp_size={stages}) needs at least one decoder block per stage; the "
            f"model has {len(blocks)}. Use a smaller pp_size."
        )
    bounds = [len(blocks) * s // stages for s in range(stages + 1)]
    kept = nn.ModuleList(blocks[bounds[stage] : bounds[stage + 1]])
    for index, block in enumerate(kept):
        for sub in block.modules():  # the cache slot each attention writes to (a plain int)
            if "layer_idx" in vars(sub):
                vars(sub)["layer_idx"] = index
    setattr(base, family.layers, kept)
    config: Any = model.config
    config.num_hidden_layers = len(kept)  # the DynamicCache's layer count
    if stage < stages - 1:
        setattr(base, family.norm, nn.Identity())
    if stage > 0 and family.positions is not None:
        setattr(base, family.positions, _NoPositions())
    return PipelineStage(model, base, stage=stage, stages=stages)


class PipelineStage(nn.Module):
    """One stage of a split causal LM, called like the model by the decoding loop.

    Not for direct construction: use :func:`split_for_pipeline`. ``forward`` takes the model's
    arguments; the last stage returns the model's output, the others their cache with zero
    logits for the newest position (the tokens come from the last stage's broadcast).
    """

    def __init__(self, model: nn.Module, base: nn.Module, *, stage: int, stages: int) -> None:
        super().__init__()
        self.model = model
        self.base = base
        self.stage = stage
        self.stages = stages
        self.group: ProcessGroup | None = None
        """The pipeline group (set by the engine before the first step)."""

    @property
    def config(self) -> Any:
        """The wrapped model's Hugging Face config."""
        return self.model.config

    def _peer(self, stage: int) -> int:
        assert self.group is not None
        return dist.get_global_rank(self.group, stage)

    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        """Run this stage's part of one decoding step (see the module docstring)."""
        config: Any = self.model.config
        hidden_size = config.hidden_size
        param = next(self.model.parameters())
        batch, length = input_ids.shape
        if self.stage == 0:
            inputs: dict[str, Any] = {"input_ids": input_ids}
        else:
            hidden = torch.empty(batch, length, hidden_size, dtype=param.dtype, device=param.device)
            dist.recv(hidden, src=self._peer(self.stage - 1), group=self.group)
            inputs = {"inputs_embeds": hidden}
        if self.stage == self.stages - 1:
            return self.model(**inputs, **kwargs)
        output = self.base(**inputs, **kwargs)
        dist.send(
            output.last_hidden_state.contiguous(), dst=self._peer(self.stage + 1), group=self.group
        )
        logits = param.new_zeros(batch, 1, config.vocab_size)  # the loop reads [:, -1]
        cache = output.get("cache", output.get("past_key_values"))
        return _StageOutput(logits=logits, cache=cache)


class _StageOutput(dict[str, Any]):
    """The cache under both names and zero logits, as the decoding loop reads them."""

    def __init__(self, *, logits: torch.Tensor, cache: Any) -> None:
        super().__init__(logits=logits, cache=cache, past_key_values=cache)
        self.logits = logits
