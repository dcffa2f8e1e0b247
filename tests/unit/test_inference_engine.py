"""``kolossos.inference`` on one process: config and input validation, the token choice, loading
from a model folder, and greedy/sampled output of a tiny GPT-2 against transformers' ``generate``.

The tensor-parallel cases (tp 1 and 2, three families) are in
``tests/dist/test_inference_generate.py``.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import transformers as tf
from torch import nn

from kolossos.inference import InferenceConfig, InferenceEngine, SamplingConfig
from kolossos.inference.sampling import select_next_tokens

QUIET = {"bos_token_id": 99, "eos_token_id": 99, "pad_token_id": 0}


def gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = tf.GPT2Config(vocab_size=100, n_positions=16, n_embd=16, n_layer=2, n_head=2, **QUIET)
    return tf.GPT2LMHeadModel(config).eval()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    return ids, (ids != 0).long()


def test_greedy_and_folder_load_equal_generate(tmp_path: Path) -> None:
    model = gpt2()
    ids, mask = batch()
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    model.save_pretrained(tmp_path)
    for engine in (InferenceEngine(copy.deepcopy(model)), InferenceEngine(tmp_path)):
        for cache in (True, False):
            got = engine.generate(ids, mask, SamplingConfig(max_new_tokens=6, use_cache=cache))
            assert torch.equal(got, expected)
    assert expected.shape[1] == 11  # EOS 99 never fired: all 6 tokens compared


def test_sampling_reproducible_by_seed() -> None:
    engine = InferenceEngine(gpt2())
    ids, mask = batch()
    config = SamplingConfig(max_new_tokens=6, do_sample=True, temperature=2.0, seed=1)
    first = engine.generate(ids, mask, config)
    assert torch.equal(first, engine.generate(ids, mask, config))
    others = [
        engine.generate(ids, mask, SamplingConfig(max_new_tokens=6, do_sample=True, seed=s))
        for s in range(2, 6)
    ]
    assert any(not torch.equal(first, o) for o in others)


def test_select_next_tokens_filters() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]]).repeat(400, 1)
    assert select_next_tokens(logits, SamplingConfig()).eq(1).all()
    gen = torch.Generator().manual_seed(0)
    for config in (
        SamplingConfig(do_sample=True, top_k=1),
        SamplingConfig(do_sample=True, top_p=0.1),
        SamplingConfig(do_sample=True, temperature=1e-3),
    ):
        assert select_next_tokens(logits, config, gen).eq(1).all(), config
    top2 = select_next_tokens(logits, SamplingConfig(do_sample=True, top_k=2), gen)
    assert set(top2.tolist()) == {1, 2}
    # softmax of (3, 2, 1, 0) is (.64, .24, .09, .03): top_p=0.8 keeps 1 and 2 (0.64 < 0.8)
    nucleus = select_next_tokens(logits, SamplingConfig(do_sample=True, top_p=0.8), gen)
    assert set(nucleus.tolist()) == {1, 2}
    free = select_next_tokens(logits, SamplingConfig(do_sample=True), gen)
    assert set(free.tolist()) == {0, 1, 2, 3}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens"),
        ({"temperature": 0.0}, ValueError, "temperature"),
        ({"top_k": -1}, ValueError, "top_k"),
        ({"top_p": 1.5}, ValueError, "top_p"),
        ({"do_sample": 1}, TypeError, "do_sample"),
        ({"seed": "7"}, TypeError, "seed"),
    ],
)
def test_sampling_config_errors(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        SamplingConfig(**kwargs)


def test_inference_config_errors() -> None:
    with pytest.raises(ValueError, match="tp_size"):
        InferenceConfig(tp_size=0)
    with pytest.raises(ValueError, match="pp_size"):
        InferenceConfig(pp_size=0)
    for config in (InferenceConfig(tp_size=2), InferenceConfig(tp_size=2, pp_size=2)):
        with pytest.raises(RuntimeError, match=r"torch\.distributed"):
            InferenceEngine(gpt2(), config)
    with pytest.raises(TypeError, match="InferenceConfig"):
        InferenceEngine(gpt2(), {"tp_size": 1})  # type: ignore[arg-type]


def test_unknown_model_family() -> None:
    bert = tf.BertForMaskedLM(
        tf.BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1,
                      num_attention_heads=2, intermediate_size=32)
    )  # fmt: skip
    for model in (bert, nn.Linear(2, 2)):
        with pytest.raises(ValueError, match="GPT2LMHeadModel, OPTForCausalLM, LlamaForCausalLM"):
            InferenceEngine(model)
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        InferenceEngine("/nonexistent/model")


@pytest.mark.parametrize(
    ("ids", "mask", "config", "error", "match"),
    [
        (torch.ones(1, 12, dtype=torch.long), None, {"max_new_tokens": 5}, ValueError, "context"),
        (torch.ones(9, 2, dtype=torch.long), None, {}, ValueError, "max_batch_size"),
        (torch.ones(2, 3), None, {}, TypeError, "integer"),
        (torch.ones(3, dtype=torch.long), None, {}, ValueError, "shape"),
        (torch.ones(1, 3, dtype=torch.long), torch.tensor([[1, 1, 0]]), {}, ValueError, "left"),
        (torch.ones(1, 3, dtype=torch.long), torch.tensor([[0, 0, 0]]), {}, ValueError, "padding"),
        (torch.ones(1, 3, dtype=torch.long), torch.tensor([[0, 2, 1]]), {}, ValueError, "only 0"),
        (torch.ones(1, 3, dtype=torch.long), torch.ones(1, 2), {}, ValueError, "shape"),
    ],
)
def test_bad_prompts(
    ids: torch.Tensor, mask: torch.Tensor | None, config: dict, error: type, match: str
) -> None:
    engine = InferenceEngine(gpt2())
    with pytest.raises(error, match=match):
        engine.generate(ids, mask, SamplingConfig(**{"max_new_tokens": 2, **config}))


def test_eos_list_from_the_model_config() -> None:
    model = gpt2()
    ids, mask = batch()
    free = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    eos = [int(free[0, 6]), int(free[1, 7])]  # each row meets one of them by step 3
    expected = model.generate(
        ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=eos
    )
    assert expected.shape[1] < free.shape[1]  # stopped early: both EOS ids took effect
    engine = InferenceEngine(copy.deepcopy(model))
    engine.model.config.eos_token_id = eos
    got = engine.generate(ids, mask, SamplingConfig(max_new_tokens=6))
    assert torch.equal(got, expected)
