"""Tensor and state-dict comparisons with Colossal-AI's ``colossalai.testing`` names and
signatures: :func:`assert_equal`, :func:`assert_not_equal`, :func:`assert_close` (torch's own),
:func:`assert_close_loose`, :func:`assert_equal_in_group`, :func:`check_state_dict_equal` and
:func:`assert_hf_output_close`.

Every check raises :class:`AssertionError` (never a bare ``assert``, so ``python -O`` keeps them)
with the path of the first differing entry, e.g. ``state['0']['exp_avg']``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.testing import assert_close

__all__ = [
    "assert_close",
    "assert_close_loose",
    "assert_equal",
    "assert_equal_in_group",
    "assert_hf_output_close",
    "assert_not_equal",
    "check_state_dict_equal",
]


def _all_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether every element of ``a == b`` (broadcast) holds; shapes that do not broadcast are
    unequal."""
    try:
        return bool(torch.all(a == b))
    except RuntimeError:  # the shapes do not broadcast
        return False


def assert_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    """Assert that ``a`` and ``b`` are equal element by element (exactly, with broadcasting).

    Raises:
        AssertionError: an element differs, or the shapes do not broadcast.

    Example:
        >>> assert_equal(torch.ones(2), torch.ones(2))
    """
    if not _all_equal(a, b):
        raise AssertionError(
            f"expected equal tensors (shapes {tuple(a.shape)} vs {tuple(b.shape)}):\n{a}\nvs\n{b}"
        )


def assert_not_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    """Assert that ``a`` and ``b`` differ in at least one element (or their shapes do not
    broadcast).

    Raises:
        AssertionError: every element is equal.

    Example:
        >>> assert_not_equal(torch.ones(2), torch.zeros(2))
    """
    if _all_equal(a, b):
        raise AssertionError(f"expected tensors that differ, but they are equal:\n{a}\nvs\n{b}")


def assert_close_loose(
    a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-3, atol: float = 1e-3
) -> None:
    """:func:`torch.testing.assert_close` with loose default tolerances (1e-3 both).

    Dtypes, devices and shapes must match, as in ``assert_close``.

    Raises:
        AssertionError: the tensors are not close; the message gives shapes, dtypes and the
            mismatch statistics.

    Example:
        >>> assert_close_loose(torch.tensor([1.0]), torch.tensor([1.0005]))
    """

    def message(detail: str) -> str:
        return (
            f"tensors not close (shape {tuple(a.shape)} vs {tuple(b.shape)}, dtype {a.dtype} vs "
            f"{b.dtype}, rtol={rtol}, atol={atol}):\n{detail}"
        )

    assert_close(a, b, rtol=rtol, atol=atol, msg=message)


def assert_equal_in_group(
    tensor: torch.Tensor, process_group: dist.ProcessGroup | None = None
) -> None:
    """Assert that ``tensor`` is identical on every rank of ``process_group`` (default: the
    default group). Collective: every rank of the group must call it.

    The shapes and dtypes are gathered first, so a rank whose tensor has another shape fails
    with a clear message instead of inside the all-gather.

    Raises:
        AssertionError: some rank's tensor differs from group rank 0's; the message names the
            ranks (ranks within ``process_group``).

    Example:
        >>> assert_equal_in_group(model.weight.detach())  # doctest: +SKIP
    """
    world_size = dist.get_world_size(process_group)
    metas: list[Any] = [None] * world_size
    dist.all_gather_object(metas, (tuple(tensor.shape), str(tensor.dtype)), group=process_group)
    if any(meta != metas[0] for meta in metas):
        raise AssertionError(f"shape/dtype differ across the group's ranks: {metas}")
    gathered = [torch.empty_like(tensor) for _ in range(world_size)]
    dist.all_gather(gathered, tensor.contiguous(), group=process_group)  # sync point
    differ = [r for r in range(1, world_size) if not _all_equal(gathered[0], gathered[r])]
    if differ:
        raise AssertionError(
            f"expected the same tensor on every rank of the group, but rank(s) {differ} differ "
            f"from rank 0:\n" + "\n".join(f"rank {r}: {gathered[r]}" for r in [0, *differ])
        )


def check_state_dict_equal(
    d1: Mapping[Any, Any],
    d2: Mapping[Any, Any],
    ignore_device: bool = True,
    ignore_dtype: bool = False,
) -> None:
    """Assert that two state dicts (nested dicts, lists and tuples of tensors and plain values,
    e.g. a model's or an optimizer's ``state_dict()``) hold the same keys and values.

    Tensors are compared with :func:`assert_close_loose` (rtol = atol = 1e-3) after moving both
    to the CPU, other values with ``==``.

    Args:
        d1: the first state dict.
        d2: the second state dict.
        ignore_device: accepted for compatibility: devices are never compared. Upstream moves
            both tensors to the CPU when it is ``False`` and lets ``assert_close``'s device check
            fail on a device mismatch when it is ``True``; tests call it with ``False`` to
            compare a GPU state dict with a loaded CPU one, and that keeps working here.
        ignore_dtype: cast each tensor of ``d1`` to the dtype of its counterpart in ``d2``
            before comparing (at every nesting level); when ``False`` the dtypes must match.

    Raises:
        AssertionError: the path of the first entry whose keys, length, type or value differ.

    Example:
        >>> check_state_dict_equal(model.state_dict(), loaded.state_dict())  # doctest: +SKIP
    """
    _check_value(d1, d2, "state_dict", ignore_dtype)


def _check_value(v1: Any, v2: Any, path: str, ignore_dtype: bool) -> None:
    if isinstance(v1, Mapping):
        if not isinstance(v2, Mapping):
            raise AssertionError(f"{path}: a mapping vs {type(v2).__name__}")
        if v1.keys() != v2.keys():
            raise AssertionError(
                f"{path}: keys differ: only in the first {_sorted(v1.keys() - v2.keys())}, only "
                f"in the second {_sorted(v2.keys() - v1.keys())}"
            )
        for key, value in v1.items():
            _check_value(value, v2[key], f"{path}[{key!r}]", ignore_dtype)
    elif isinstance(v1, (list, tuple)):
        _check_sequence(v1, v2, path, ignore_dtype)
    elif isinstance(v1, torch.Tensor):
        if not isinstance(v2, torch.Tensor):
            raise AssertionError(f"{path}: a tensor vs {type(v2).__name__}")
        a, b = v1.detach().cpu(), v2.detach().cpu()
        if ignore_dtype:
            a = a.to(b.dtype)
        try:
            assert_close_loose(a, b)
        except AssertionError as exc:
            raise AssertionError(f"{path}: {exc}") from None
    elif isinstance(v2, torch.Tensor):
        raise AssertionError(f"{path}: {type(v1).__name__} vs a tensor")
    elif v1 != v2:
        raise AssertionError(f"{path}: {v1!r} != {v2!r}")


def _check_sequence(v1: Sequence[Any], v2: Any, path: str, ignore_dtype: bool) -> None:
    if not isinstance(v2, (list, tuple)):
        raise AssertionError(f"{path}: a {type(v1).__name__} vs {type(v2).__name__}")
    if len(v1) != len(v2):
        raise AssertionError(f"{path}: lengths differ, {len(v1)} vs {len(v2)}")
    for i, (a, b) in enumerate(zip(v1, v2, strict=True)):
        _check_value(a, b, f"{path}[{i}]", ignore_dtype)


def _sorted(keys: Iterable[Any]) -> list[Any]:
    return sorted(keys, key=repr)


def assert_hf_output_close(
    out1: Any,
    out2: Any,
    ignore_keys: list[str] | None = None,
    track_name: str = "",
    atol: float = 1e-5,
    rtol: float = 1e-5,
) -> None:
    """Assert that two model outputs (Hugging Face ``ModelOutput``s, dicts, lists, tuples,
    tensors or plain values, nested) are close.

    Args:
        out1: the first output.
        out2: the second output.
        ignore_keys: dict keys skipped at every level (e.g. ``["past_key_values"]``); they may
            also be missing from either side.
        track_name: the name of the outputs in messages (``"output"`` when empty); nested
            entries append ``.key`` or ``.index``, e.g. ``output.hidden_states.3``.
        atol: absolute tolerance for tensors.
        rtol: relative tolerance for tensors.

    Raises:
        AssertionError: the path of the first entry whose keys, length, shape or value differ.

    Example:
        >>> assert_hf_output_close(model(**batch), sharded_model(**batch),
        ...                        ignore_keys=["past_key_values"])  # doctest: +SKIP
    """
    ignored = set(ignore_keys or ())
    where = track_name or "output"
    if isinstance(out1, Mapping) and isinstance(out2, Mapping):
        keys1, keys2 = set(out1.keys()) - ignored, set(out2.keys()) - ignored
        if keys1 != keys2:
            raise AssertionError(
                f"{where}: keys differ: {_sorted(keys1 - keys2)} vs {_sorted(keys2 - keys1)}"
            )
        for key in out1:
            if key not in ignored:
                assert_hf_output_close(
                    out1[key], out2[key], ignore_keys, f"{where}.{key}", atol, rtol
                )
    elif isinstance(out1, (list, tuple)) and isinstance(out2, (list, tuple)):
        if len(out1) != len(out2):
            raise AssertionError(f"{where}: lengths differ, {len(out1)} vs {len(out2)}")
        for i, (a, b) in enumerate(zip(out1, out2, strict=True)):
            assert_hf_output_close(a, b, ignore_keys, f"{where}.{i}", atol, rtol)
    elif isinstance(out1, torch.Tensor) and isinstance(out2, torch.Tensor):
        if out1.shape != out2.shape:
            raise AssertionError(
                f"{where}: shape mismatch, {tuple(out1.shape)} vs {tuple(out2.shape)}"
            )
        assert_close(out1, out2, atol=atol, rtol=rtol, msg=lambda m: f"{where}: {m}")
    elif isinstance(out1, torch.Tensor) or isinstance(out2, torch.Tensor):
        raise AssertionError(
            f"{where}: {type(out1).__name__} vs {type(out2).__name__} (one is a tensor)"
        )
    elif out1 != out2:
        raise AssertionError(f"{where}: value mismatch, {out1!r} vs {out2!r}")
