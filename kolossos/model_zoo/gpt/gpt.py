"""``model_zoo.gpt.gpt``: :mod:`kolossos.legacy.models.gpt` and the hand-split pipeline GPT of
:mod:`kolossos.legacy.models.gpt_pipeline` under the tutorial's module name."""

from kolossos.legacy.models.gpt import (
    GPT,
    GPTMLP,
    GPTBlock,
    GPTEmbedding,
    GPTLMHead,
    GPTLMLoss,
    GPTSelfAttention,
)
from kolossos.legacy.models.gpt_pipeline import (
    GPT2_exlarge_pipeline_hybrid,
    GPT3_pipeline_hybrid,
    PipelineGPTHybrid,
    build_gpt_pipeline,
)

__all__ = [
    "GPT",
    "GPTMLP",
    "GPT2_exlarge_pipeline_hybrid",
    "GPT3_pipeline_hybrid",
    "GPTBlock",
    "GPTEmbedding",
    "GPTLMHead",
    "GPTLMLoss",
    "GPTSelfAttention",
    "PipelineGPTHybrid",
    "build_gpt_pipeline",
]
