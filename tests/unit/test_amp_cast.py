"""The one cast helper: nested containers keep their types, integer tensors keep their dtype,
the input is not modified, and tensors can be moved at the same time."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import torch

from kolossos.amp import cast_floating

Pair = namedtuple("Pair", ["x", "ids"])


class Output(OrderedDict):  # type: ignore[type-arg]
    """A dict subclass, as Hugging Face's ModelOutput."""


def test_nested_floating_tensors_are_cast_and_integers_are_not() -> None:
    value = (torch.ones(1), {"ids": torch.ones(1, dtype=torch.long)}, [torch.zeros(2)])
    out = cast_floating(value, torch.bfloat16)
    assert isinstance(out, tuple) and isinstance(out[2], list)
    assert out[0].dtype == torch.bfloat16 and out[2][0].dtype == torch.bfloat16
    assert out[1]["ids"].dtype == torch.long


def test_container_types_survive_and_the_input_is_not_modified() -> None:
    pair = Pair(torch.ones(2), torch.arange(2))
    out = cast_floating(pair, torch.float16)
    assert type(out) is Pair and out.x.dtype == torch.float16 and out.ids.dtype == torch.int64
    output = Output(logits=torch.ones(2))
    cast = cast_floating(output, torch.bfloat16)
    assert type(cast) is Output and cast["logits"].dtype == torch.bfloat16
    assert output["logits"].dtype == torch.float32  # the original is untouched


def test_device_move_and_non_tensors() -> None:
    out = cast_floating({"x": torch.ones(1), "n": 3, "s": "a"}, torch.float64, torch.device("cpu"))
    assert out["x"].dtype == torch.float64 and out["n"] == 3 and out["s"] == "a"
    same = torch.ones(1)
    assert cast_floating(same, torch.float32) is same  # no copy when nothing changes
