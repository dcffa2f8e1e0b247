"""How the legacy pipeline schedules cut a batch into micro-batches and feed each stage, as
Colossal-AI's ``PipelineSchedule`` does:

* **Slicing.** Every tensor of the batch (of one dimension or more) is cut along dim 0 into
  ``num_microbatches`` equal slices; lists, tuples and dicts are followed. A list or tuple that
  holds dicts is merged into one dict, and the tensors after the first dict become its
  ``"label"`` entry (upstream's ``(data_dict, label)`` form).
* **Data and label per stage.** A ``(data, label)`` pair feeds ``data`` to the first stage and the
  previous stage's output to the others; ``label`` reaches the criterion on the last stage. A dict
  is passed as keyword arguments to *every* stage (the stage output first, positionally, after the
  first stage); its ``"label"`` entry is the label. A ``data_process_func(stage_output,
  micro_batch) -> (data, label)`` replaces these rules.
* **Calling a stage.** A tensor is passed positionally, a list/tuple unpacked, a dict as keyword
  arguments (with its ``"stage_output"`` entry, if any, first and positionally).
* **A stage's output.** Every stage but the last returns one tensor (the docs' rule), checked
  before it is sent (:func:`check_stage_output`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "call_stage",
    "check_stage_inputs",
    "check_stage_output",
    "data_and_label",
    "merge_micro",
    "split_micro_batches",
]

StageDataFunc = Callable[[Any, Any], tuple[Any, Any]]


def _slice(value: Any, start: int, stop: int) -> Any:
    if isinstance(value, torch.Tensor):
        return value[start:stop] if value.dim() > 0 else value
    if isinstance(value, dict):
        return {k: _slice(v, start, stop) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_slice(v, start, stop) for v in value)
    return value


def _micro(batch: Any, start: int, stop: int) -> Any:
    """One micro-batch: upstream's rule for a list/tuple holding dicts, else a plain slice."""
    if isinstance(batch, (list, tuple)) and any(isinstance(e, dict) for e in batch):
        merged: dict[str, Any] = {}
        for element in batch:
            if isinstance(element, dict):
                merged.update(_slice(element, start, stop))
            elif merged:  # what follows the data dict is the label (as upstream)
                merged["label"] = _slice(element, start, stop)
        return merged
    return _slice(batch, start, stop)


def split_micro_batches(batch: Any, batch_size: int | None, num_microbatches: int) -> list[Any]:
    """``batch`` cut into ``num_microbatches`` equal micro-batches along dim 0.

    Args:
        batch: a tensor, or a list/tuple/dict of them (nested).
        batch_size: the leading dimension of the batch's first tensor.
        num_microbatches: the number of micro-batches.

    Raises:
        ValueError: the batch has no tensor, or its size is not a multiple of
            ``num_microbatches``.

    Example:
        >>> parts = split_micro_batches((torch.ones(4, 2), torch.zeros(4)), 4, 2)
        >>> [p[0].shape[0] for p in parts]
        [2, 2]
    """
    if batch_size is None:
        raise ValueError(
            "the pipeline schedule found no tensor with a batch dimension in the batch; give "
            "batches of tensors (e.g. (data, label)) whose dim 0 is the batch size."
        )
    if batch_size % num_microbatches:
        raise ValueError(
            f"the batch size {batch_size} is not divisible by num_microbatches="
            f"{num_microbatches}: every micro-batch must have the same size; use a batch size "
            f"that is a multiple of {num_microbatches} (e.g. drop_last=True in the dataloader) "
            "or change NUM_MICRO_BATCHES."
        )
    size = batch_size // num_microbatches
    return [_micro(batch, i * size, (i + 1) * size) for i in range(num_microbatches)]


def data_and_label(
    stage_output: Any, micro_batch: Any, first: bool, func: StageDataFunc | None
) -> tuple[Any, Any]:
    """``(data, label)`` of one stage for one micro-batch (see the module docstring).

    Args:
        stage_output: the previous stage's output (``None`` on the first stage).
        micro_batch: the micro-batch, as :func:`split_micro_batches` made it.
        first: whether this is the first stage of the pipeline.
        func: the schedule's ``data_process_func``, if any.

    Raises:
        TypeError: a list/tuple micro-batch that is not a ``(data, label)`` pair.
    """
    if func is not None:
        return func(stage_output, micro_batch)
    if isinstance(micro_batch, dict):
        kwargs = dict(micro_batch)
        label = kwargs.pop("label", None)
        return {"stage_output": stage_output, **kwargs}, label
    if isinstance(micro_batch, (list, tuple)):
        if len(micro_batch) != 2:
            raise TypeError(
                f"a pipeline batch given as a list/tuple must be a (data, label) pair, got "
                f"{len(micro_batch)} items; return (data, label) from the dataloader or pass "
                "data_process_func(stage_output, micro_batch) -> (data, label)."
            )
        data, label = micro_batch
        return (data if first else stage_output), label
    return (micro_batch if first else stage_output), None


def call_stage(stage: Callable[..., Any], data: Any) -> Any:
    """Run ``stage`` on ``data`` (see the module docstring).

    Raises:
        TypeError: ``data`` (or its ``"stage_output"``) has an unsupported type.
    """
    if isinstance(data, torch.Tensor):
        return stage(data)
    if isinstance(data, (list, tuple)):
        return stage(*data)
    if isinstance(data, dict):
        kwargs = dict(data)
        stage_output = kwargs.pop("stage_output", None)
        if stage_output is None:
            return stage(**kwargs)
        if isinstance(stage_output, torch.Tensor):
            return stage(stage_output, **kwargs)
        if isinstance(stage_output, (list, tuple)):
            return stage(*stage_output, **kwargs)
        raise TypeError(
            f"a stage output must be a tensor, list or tuple, got {type(stage_output).__name__}."
        )
    raise TypeError(
        f"stage inputs must be a tensor, list, tuple or dict, got {type(data).__name__}; return "
        "one of these from data_process_func."
    )


def check_stage_inputs(
    stage_fn: Callable[..., Any], data: Any, stage: int, pipeline_rank: int
) -> None:
    """The docs' rule for dict batches: every stage takes the dict's entries as keyword
    arguments, so its ``forward`` must name them (or take ``**kwargs``).

    Raises:
        TypeError: ``forward`` takes none of that name (raised before the stage runs).
    """
    if not isinstance(data, dict):
        return
    try:
        params = inspect.signature(stage_fn).parameters.values()
    except (TypeError, ValueError):  # no signature to check: let the call decide
        return
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    missing = [k for k in data if k != "stage_output" and k not in names]
    if missing:
        raise TypeError(
            f"pipeline stage {stage} (pipeline rank {pipeline_rank}) gets the dict batch's "
            f"entries {missing} as keyword arguments, but its forward does not take them; every "
            "stage's forward must name every key of the batch dict (e.g. forward(self, "
            "hidden_states=None, input_ids=None, attention_mask=None)) or take **kwargs."
        )


def check_stage_output(output: Any, stage: int, num_stages: int, pipeline_rank: int) -> None:
    """The docs' rule: a stage that is not the last returns a single tensor.

    Args:
        output: what the stage's forward returned.
        stage: its virtual stage (``chunk * pipeline_size + pipeline_rank``).
        num_stages: the number of virtual stages.
        pipeline_rank: this process's pipeline rank.

    Raises:
        TypeError: ``output`` is not a tensor (raised before anything is sent).
    """
    if stage == num_stages - 1 or isinstance(output, torch.Tensor):
        return
    kind = type(output).__name__
    if isinstance(output, (list, tuple)):
        kind = f"a {kind} of {len(output)} items"
    raise TypeError(
        f"pipeline stage {stage} of {num_stages} (pipeline rank {pipeline_rank}) returned {kind}; "
        "every stage but the last must return a single tensor (the next stage's first "
        "positional input). Return only the activation, and pass the other inputs (e.g. an "
        "attention mask) to every stage through a dict batch, as keyword arguments."
    )


def merge_micro(values: list[Any]) -> Any:
    """Per-micro-batch outputs (or labels) joined along dim 0 (lists/tuples/dicts followed;
    ``None`` stays ``None``)."""
    first = values[0]
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        return torch.cat(values, dim=0) if first.dim() > 0 else torch.stack(values)
    if isinstance(first, dict):
        return {k: merge_micro([v[k] for v in values]) for k in first}
    if isinstance(first, (list, tuple)):
        return type(first)(merge_micro(list(col)) for col in zip(*values, strict=True))
    return values
