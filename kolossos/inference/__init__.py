"""Generation with Hugging Face causal LMs (GPT-2, OPT, LLaMA), tensor- and pipeline-parallel.

:class:`InferenceEngine` shards a model with the :mod:`kolossos.shardformer` plans, splits its
blocks over pipeline stages (:mod:`~kolossos.inference.pipeline`), or both
(:mod:`~kolossos.inference.groups`), and decodes with its own key/value cache (greedy,
temperature, top-k, top-p; left-padded batches). ``kolossos serve`` builds on it:
:mod:`~kolossos.inference.batching` (continuous and static batching),
:mod:`~kolossos.inference.scheduler` (FIFO queue, the loop every rank of a replica runs),
:mod:`~kolossos.inference.result_cache`, and :mod:`~kolossos.inference.http_api`,
:mod:`~kolossos.inference.http_service` and :mod:`~kolossos.inference.chat_api` (FastAPI,
imported only by the server). See ``docs/inference.md``.

Example:
    >>> from kolossos.inference import InferenceConfig, InferenceEngine, SamplingConfig
    >>> engine = InferenceEngine(model, InferenceConfig(tp_size=2))  # doctest: +SKIP
    >>> tokens = engine.generate(input_ids, attention_mask, SamplingConfig(max_new_tokens=8))
    ... # doctest: +SKIP
"""

from kolossos.inference.config import InferenceConfig
from kolossos.inference.engine import InferenceEngine
from kolossos.inference.sampling import SamplingConfig

__all__ = ["InferenceConfig", "InferenceEngine", "SamplingConfig"]
