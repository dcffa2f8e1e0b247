"""The legacy model zoo and its data helpers without a process group: the documented import
paths, shapes, ``init_method``, the GPT pieces' contracts, ``WebtextDataset`` (tokenisation,
cache, errors) and ``build_cifar`` (the documented transforms, the synthetic stand-in)."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

from kolossos.legacy.data import CifarTransform, WebtextDataset, build_cifar, gpt2_tokenizer
from kolossos.legacy.data.webtext import TINY_VOCAB, write_sample_webtext
from kolossos.legacy.models.gpt import GPTLMHead, GPTLMLoss


def test_documented_import_paths() -> None:
    import kolossos.model_zoo.gpt.gpt as col_gpt
    from kolossos.model_zoo.gpt import GPTLMLoss as Loss
    from kolossos.model_zoo.vit.vit import ViTBlock, ViTEmbedding, ViTHead, _create_vit_model
    from kolossos.utils import checkpoint

    assert Loss is GPTLMLoss and callable(checkpoint)
    assert {ViTBlock, ViTEmbedding, ViTHead, _create_vit_model}
    for name in ("GPTEmbedding", "GPTBlock", "GPTLMHead", "PipelineGPTHybrid",
                 "GPT2_exlarge_pipeline_hybrid", "GPT3_pipeline_hybrid"):  # fmt: skip
        assert hasattr(col_gpt, name), name


def test_vit_shapes_and_init_methods() -> None:
    from kolossos.model_zoo.vit.vit import _create_vit_model

    kwargs = dict(img_size=16, patch_size=4, dim=32, depth=2, num_heads=4, mlp_ratio=2,
                  num_classes=7)  # fmt: skip
    jax = _create_vit_model(init_method="jax", **kwargs)
    assert jax(torch.randn(2, 3, 16, 16)).shape == (2, 7)
    head = jax.layers[-1].dense
    assert not head.weight.any() and not head.bias.any()  # 'jax' zeroes the classifier
    assert jax.layers[1].attn.query_key_value.bias.abs().max() == 0
    assert 0 < jax.layers[1].mlp.dense_1.bias.abs().max() < 1e-4  # N(0, 1e-6)
    torch_init = _create_vit_model(init_method="torch", representation_size=16, **kwargs)
    assert torch_init.layers[-1].dense.weight.any()
    assert torch_init(torch.randn(2, 3, 16, 16)).shape == (2, 7)
    with pytest.raises(ValueError, match="init_method='flax' must be one of"):
        _create_vit_model(init_method="flax", **kwargs)
    with pytest.raises(ValueError, match="not divisible by patch_size"):
        _create_vit_model(**{**kwargs, "patch_size": 5})


def test_gpt_hybrid_builders_at_small_size() -> None:
    from kolossos.model_zoo.gpt import GPT3_pipeline_hybrid

    model = GPT3_pipeline_hybrid(num_layers=2, hidden_size=32, num_attention_heads=4,
                                 vocab_size=96, max_position_embeddings=8)  # fmt: skip
    assert len(model.blocks) == 2
    assert model.head.weight is model.embedding.word_embeddings.weight  # one stage: tied in place
    ids = torch.randint(0, 96, (2, 8))
    logits = model(input_ids=ids, attention_mask=torch.ones(2, 8))
    assert logits.shape == (2, 8, 96)
    assert GPTLMLoss()(logits, ids).ndim == 0
    with pytest.raises(ValueError, match="first GPT stage needs input_ids"):
        model(attention_mask=torch.ones(2, 8))


def test_gpt_head_tie_shape_error() -> None:
    with pytest.raises(ValueError, match="cannot be tied"):
        GPTLMHead(16, 32, word_embeddings_weight=torch.nn.Parameter(torch.zeros(31, 16)))


def test_gpt_lm_loss_is_shifted_cross_entropy() -> None:
    logits, labels = torch.randn(2, 5, 11), torch.randint(0, 11, (2, 5))
    want = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, 11), labels[:, 1:].reshape(-1)
    )
    torch.testing.assert_close(GPTLMLoss()(logits, labels), want)


def test_webtext_dataset_tokenises_and_caches(tmp_path: Path) -> None:
    path = write_sample_webtext(tmp_path / "train.json", num_docs=6, words_per_doc=40)
    with path.open("a") as f:
        f.write(json.dumps({"text": "Short."}) + "\n")  # padded to the longest
    data = WebtextDataset(path, seq_len=12)
    assert len(data) == 7
    sample, label = data[6]
    assert sample["input_ids"].shape == (12,) and torch.equal(label, sample["input_ids"])
    assert 0 < int(sample["attention_mask"].sum()) < 12  # "Short." is padded
    assert int(data[0][0]["attention_mask"].sum()) == 12  # long documents are truncated
    cache = tmp_path / "gpt_webtext_12.pt"
    assert cache.is_file()
    path.unlink()  # the cache alone serves the same seq_len ...
    assert torch.equal(WebtextDataset(path, seq_len=12).data, data.data)
    with pytest.raises(FileNotFoundError, match="no file"):  # ... but not another one
        WebtextDataset(path, seq_len=10)


def test_webtext_dataset_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"text": "fine"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad.json:2: not a JSON object with a 'text' field"):
        WebtextDataset(bad, seq_len=8)
    with pytest.raises(FileNotFoundError, match="lacks"):
        gpt2_tokenizer(tmp_path)


def test_gpt2_tokenizer_from_a_vocab_dir(tmp_path: Path) -> None:
    shutil.copy(TINY_VOCAB[0], tmp_path / "vocab.json")
    shutil.copy(TINY_VOCAB[1], tmp_path / "merges.txt")
    tok = gpt2_tokenizer(tmp_path)
    assert len(tok) == 1024 and tok.pad_token == tok.unk_token == "<|endoftext|>"
    ids = tok("To be, or not to be")["input_ids"]
    assert tok.decode(ids) == "To be, or not to be"


def test_cifar_transform_documented_pipelines() -> None:
    image = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8)
    vit = CifarTransform(crop=40, pad_if_needed=True, resize=48)  # RandomCrop(pad_if_needed)
    assert vit(image).shape == (3, 48, 48)
    titans = CifarTransform(crop=32, padding=4, resize=32, flip=True)
    out = titans(image)
    assert out.shape == (3, 32, 32) and out.dtype == torch.float32
    with pytest.raises(ValueError, match="larger than the 32x32 image"):
        CifarTransform(crop=40)(image)
    test = CifarTransform()(image)  # ToTensor + Normalize
    want = (image.float() / 255 - torch.tensor([0.4914, 0.4822, 0.4465])[:, None, None]) / \
        torch.tensor([0.2023, 0.1994, 0.2010])[:, None, None]  # fmt: skip
    torch.testing.assert_close(test, want)


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is not None, reason="has torchvision")
def test_auto_augment_without_torchvision_says_so() -> None:
    with pytest.raises(ImportError, match=r"auto_augment=True\) needs torchvision"):
        CifarTransform(auto_augment=True)


def test_build_cifar_synthetic_stand_in(tmp_path: Path) -> None:
    train, test = build_cifar(4, root=tmp_path, synthetic_size=16, crop=24, resize=24,
                              padding=None)  # fmt: skip
    x, y = next(iter(train))
    assert x.shape == (4, 3, 24, 24) and y.shape == (4,)
    assert next(iter(test))[0].shape == (4, 3, 24, 24)
    assert len(train.dataset) == 16 and len(test.dataset) == 4


def test_gpt_refuses_multi_dimensional_modes(monkeypatch: pytest.MonkeyPatch) -> None:
    import kolossos.legacy.models.gpt as gpt_module

    monkeypatch.setattr(gpt_module, "tensor_mode", lambda: "2d")
    with pytest.raises(NotImplementedError, match="not mode='2d'"):
        gpt_module.GPTBlock(16, 2)
