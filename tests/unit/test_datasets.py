"""CIFAR-10 loading (real format, safe unpickling, download), synthetic fallback, transforms."""

from __future__ import annotations

import io
import logging
import os
import pickle
import struct
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from kolossos.datasets import (
    CIFAR10,
    CIFAR10_MEAN,
    CIFAR10_STD,
    ImageTransform,
    SyntheticImageDataset,
    SyntheticTokenDataset,
    UnsafePickleError,
    download_cifar10,
    find_cifar10,
    get_cifar10,
    load_cifar10_batch,
)
from kolossos.datasets import cifar10 as cifar10_module

FILES = [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def warnings_log(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Records]:
    """Records of the CIFAR-10 logger, with the once-per-process warning re-armed."""
    monkeypatch.setattr(cifar10_module, "_warned", [])
    monkeypatch.delenv("DATA", raising=False)
    handler, logger = _Records(), logging.getLogger(cifar10_module.__name__)
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


def _save_py2_str(pickler: Any, obj: bytes) -> None:
    """Write bytes as a Python 2 ``str``, the way the official CIFAR-10 files were made."""
    n = len(obj)
    head = (
        pickle.SHORT_BINSTRING + bytes([n]) if n < 256 else pickle.BINSTRING + struct.pack("<i", n)
    )
    pickler.write(head + obj)
    pickler.memoize(obj)


class _Py2Pickler(pickle._Pickler):
    dispatch: ClassVar[dict[type, Any]] = {**pickle._Pickler.dispatch, bytes: _save_py2_str}


def _dumps(entry: object, flavour: str) -> bytes:
    if flavour != "py2":
        return pickle.dumps(entry, protocol=int(flavour[-1]))
    buffer = io.BytesIO()
    _Py2Pickler(buffer, protocol=2).dump(entry)
    # numpy 1.x (which wrote the official files) named its module numpy.core.
    return buffer.getvalue().replace(b"numpy._core.multiarray\n", b"numpy.core.multiarray\n")


def write_fake_cifar(root: Path, per_file: int = 3, flavour: str = "py2") -> Path:
    """A cifar-10-batches-py directory in the real format, with a few recognisable samples."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    for k, name in enumerate(FILES):
        data = np.arange(per_file * 3072, dtype=np.int64).reshape(per_file, 3072)
        data = ((data + 7 * k) % 256).astype(np.uint8)
        entry = {
            b"batch_label": f"batch {k}".encode(),
            b"labels": [(k + i) % 10 for i in range(per_file)],
            b"data": data,
            b"filenames": [f"img_{k}_{i}.png".encode() for i in range(per_file)],
        }
        (folder / name).write_bytes(_dumps(entry, flavour))
    return folder


# ---------------------------------------------------------------- real data path


@pytest.mark.parametrize("flavour", ["py2", "protocol2", "protocol5"])
def test_loads_real_format_from_root(tmp_path: Path, flavour: str) -> None:
    write_fake_cifar(tmp_path, flavour=flavour)
    train, test = CIFAR10(root=tmp_path, train=True), CIFAR10(root=str(tmp_path), train=False)
    assert not train.is_synthetic and len(train) == 15 and len(test) == 3
    image, label = train[4]  # second sample of data_batch_2
    assert image.dtype == torch.uint8 and image.shape == (3, 32, 32) and label == 2
    expected = ((np.arange(3072) + 3072 + 7) % 256).astype(np.uint8).reshape(3, 32, 32)
    assert torch.equal(image, torch.from_numpy(expected))
    assert test.targets == [5, 6, 7]


def test_finds_data_through_the_data_variable(tmp_path: Path, warnings_log: _Records) -> None:
    folder = write_fake_cifar(tmp_path)
    os.environ["DATA"] = str(tmp_path)  # removed again by the fixture's monkeypatch
    assert find_cifar10() == folder
    assert find_cifar10(folder) == folder  # the batch directory itself works as root
    ds = get_cifar10(train=False, normalize=False)
    assert not ds.is_synthetic and ds[0][0].dtype == torch.float32
    assert float(ds[0][0].max()) <= 1.0
    assert not warnings_log.records


def test_malicious_pickle_is_rejected(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return os.system, (f"touch {marker}",)

    path = tmp_path / "data_batch_1"
    for protocol in (2, 5):
        path.write_bytes(pickle.dumps({"data": Exploit(), "labels": []}, protocol=protocol))
        with pytest.raises(UnsafePickleError, match=r"refusing to load '(posix|nt|os)\.system'"):
            load_cifar10_batch(path)
    # The one non-numpy callable allowed (_codecs.encode, for bytes) cannot be turned against us.
    path.write_bytes(pickle.dumps({"data": _Encode()}, protocol=2))
    with pytest.raises(UnsafePickleError, match=r"_codecs\.encode"):
        load_cifar10_batch(path)
    assert not marker.exists()


class _Encode:
    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        import codecs

        return codecs.encode, ("eJwDAAAAAAE=", "base64")


def test_non_cifar_pickle_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "test_batch"
    path.write_bytes(pickle.dumps({b"data": np.zeros((2, 10), np.uint8), b"labels": [0, 1]}))
    with pytest.raises(ValueError, match=r"\(N, 3072\) uint8"):
        load_cifar10_batch(path)
    path.write_bytes(pickle.dumps([1, 2, 3]))
    with pytest.raises(ValueError, match="not a CIFAR-10 batch"):
        load_cifar10_batch(path)


def test_download_from_archive(tmp_path: Path, warnings_log: _Records) -> None:
    source = tmp_path / "src"
    write_fake_cifar(source)
    archive = tmp_path / "cifar.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(source / "cifar-10-batches-py", arcname="cifar-10-batches-py")
        evil = tarfile.TarInfo("cifar-10-batches-py/../../escaped")
        evil.size = 1
        tar.addfile(evil, io.BytesIO(b"x"))
    target = tmp_path / "data"
    folder = download_cifar10(target, url=archive.as_uri(), md5=None)
    assert folder == target / "cifar-10-batches-py" and find_cifar10(target) == folder
    assert not (tmp_path / "escaped").exists()
    assert len(CIFAR10(target, train=True)) == 15
    with pytest.raises(ValueError, match="MD5"):
        download_cifar10(tmp_path / "other", url=archive.as_uri(), md5="0" * 32)


def test_failed_download_falls_back_with_reason(tmp_path: Path, warnings_log: _Records) -> None:
    missing = (tmp_path / "no-such-archive.tar.gz").as_uri()
    original = cifar10_module.download_cifar10

    def fake(root: str | os.PathLike[str]) -> Path:
        return original(root, url=missing)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cifar10_module, "download_cifar10", fake)
        ds = CIFAR10(tmp_path / "data", download=True, synthetic_size=4)
    assert ds.is_synthetic
    assert "Downloading into" in warnings_log.records[0].getMessage()


# ---------------------------------------------------------------- synthetic fallback


def test_synthetic_fallback_shapes_dtypes_and_one_warning(warnings_log: _Records) -> None:
    train = CIFAR10(root="/nonexistent/cifar", train=True)
    test = CIFAR10(root="/nonexistent/cifar", train=False, synthetic_size=20)
    assert train.is_synthetic and len(train) == 50_000 and len(test) == 20
    image, label = train[123]
    assert image.shape == (3, 32, 32) and image.dtype == torch.uint8
    assert isinstance(label, int) and 0 <= label < 10
    assert sorted(set(train.targets)) == list(range(10))
    assert [train.targets.count(c) for c in range(10)] == [5000] * 10
    assert len(warnings_log.records) == 1  # one warning for both splits
    message = warnings_log.records[0].getMessage()
    assert warnings_log.records[0].levelno == logging.WARNING
    assert "SYNTHETIC" in message and "DATA" in message and "/nonexistent/cifar" in message


def test_synthetic_fallback_is_deterministic_and_splits_differ(warnings_log: _Records) -> None:
    a, b = CIFAR10(None, synthetic_size=10), CIFAR10(None, synthetic_size=10)
    assert all(torch.equal(a[i][0], b[i][0]) for i in range(10)) and a.targets == b.targets
    c = CIFAR10(None, synthetic_size=10, seed=1)
    assert not torch.equal(a[0][0], c[0][0])
    test = CIFAR10(None, train=False, synthetic_size=10)
    assert not torch.equal(a[0][0], test[0][0])
    torch.manual_seed(5)  # the global RNG plays no part
    assert torch.equal(a[3][0], b[3][0])


def test_missing_data_can_be_an_error(warnings_log: _Records) -> None:
    with pytest.raises(FileNotFoundError, match="CIFAR-10 not found"):
        CIFAR10("/nonexistent", allow_synthetic=False)


def test_synthetic_images_are_learnable_by_a_linear_model() -> None:
    train = SyntheticImageDataset(400, (3, 8, 8), num_classes=4, seed=0, dtype=torch.float32)
    test = SyntheticImageDataset(200, (3, 8, 8), 4, seed=0, index_offset=400, dtype=torch.float32)

    def stack(ds: SyntheticImageDataset) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = zip(*(ds[i] for i in range(len(ds))), strict=True)
        return torch.stack(xs).flatten(1), torch.tensor(ys)

    (x, y), (xt, yt) = stack(train), stack(test)
    torch.manual_seed(0)
    model = torch.nn.Linear(x.shape[1], 4)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(30):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    accuracy = (model(xt).argmax(1) == yt).float().mean().item()
    assert accuracy > 0.8, accuracy


def test_synthetic_image_validation_and_indexing() -> None:
    ds = SyntheticImageDataset(5, (1, 4, 4), 2)
    assert torch.equal(ds[-1][0], ds[4][0])
    with pytest.raises(IndexError):
        ds[5]
    with pytest.raises(ValueError, match="size=0"):
        SyntheticImageDataset(0)


def test_synthetic_tokens() -> None:
    ds = SyntheticTokenDataset(vocab_size=50, seq_len=200, size=6, seed=3)
    sample = ds[2]
    ids = sample["input_ids"]
    assert ids.dtype == torch.long and ids.shape == (200,) and ids.min() >= 0 and ids.max() < 50
    assert torch.equal(sample["labels"], ids) and sample["attention_mask"].sum() == 200
    assert torch.equal(SyntheticTokenDataset(50, 200, 6, seed=3)[2]["input_ids"], ids)
    assert not torch.equal(ds[3]["input_ids"], ids)
    follows = (ds.successor[ids[:-1]] == ids[1:]).float().mean().item()
    assert 0.65 < follows < 0.9  # follow_prob=0.75 plus chance hits
    with pytest.raises(ValueError, match="follow_prob"):
        SyntheticTokenDataset(10, 10, 10, follow_prob=1.5)


# ---------------------------------------------------------------- transforms


def test_get_cifar10_normalises_and_augments(warnings_log: _Records) -> None:
    plain = get_cifar10(synthetic_size=4, normalize=False)
    normed = get_cifar10(synthetic_size=4)
    x, xn = plain[0][0], normed[0][0]
    mean = torch.tensor(CIFAR10_MEAN).view(3, 1, 1)
    std = torch.tensor(CIFAR10_STD).view(3, 1, 1)
    torch.testing.assert_close(xn, (x - mean) / std)
    augmented = get_cifar10(synthetic_size=4, normalize=False, augment=True)
    torch.manual_seed(0)
    views = [augmented[0][0] for _ in range(8)]
    assert all(v.shape == (3, 32, 32) for v in views)
    assert any(not torch.equal(v, x) for v in views)


def test_image_transform_crop_and_flip() -> None:
    image = torch.arange(16, dtype=torch.uint8).view(1, 4, 4)
    torch.manual_seed(0)
    flipped = ImageTransform(flip=True)
    row = image[0, 0].float() / 255
    outs = {tuple(flipped(image)[0, 0].tolist()) for _ in range(20)}
    assert outs == {tuple(row.tolist()), tuple(row.flip(0).tolist())}
    cropped = ImageTransform(crop_padding=1)(image.float())
    assert cropped.shape == (1, 4, 4) and set(cropped.unique().tolist()) <= set(range(16))
    with pytest.raises(ValueError, match="together"):
        ImageTransform(mean=(0.5,))
