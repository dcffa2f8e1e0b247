"""``model_zoo.gpt``: the zoo's GPT (:mod:`kolossos.model_zoo.gpt.gpt`); ``from
kolossos.model_zoo.gpt import GPTLMLoss`` as the GPT tutorial does. Resolved lazily."""

from __future__ import annotations

from kolossos._lazy import lazy_attributes

_GPT = "kolossos.legacy.models.gpt"
_PIPE = "kolossos.legacy.models.gpt_pipeline"
_LAZY = {
    **{
        name: (_GPT, name) for name in ("GPT", "GPTBlock", "GPTEmbedding", "GPTLMHead", "GPTLMLoss")
    },
    **{
        name: (_PIPE, name)
        for name in (
            "GPT2_exlarge_pipeline_hybrid",
            "GPT3_pipeline_hybrid",
            "PipelineGPTHybrid",
            "build_gpt_pipeline",
        )
    },
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_attributes(__name__, globals(), _LAZY)
