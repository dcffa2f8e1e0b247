"""``ModelFromConfig`` (Colossal-AI's ``colossalai.nn.model.ModelFromConfig``): a model described
by a list of layer configs, so :func:`~kolossos.legacy.builder.build_pipeline_model_from_cfg` can
give each pipeline stage its own range of layers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.nn as nn

from kolossos.legacy.registry import LAYERS, build_from_registry

__all__ = ["ModelFromConfig", "build_layer"]


def build_layer(config: dict[str, Any]) -> nn.Module:
    """One layer from ``dict(type='Name', **kwargs)``: a class registered in ``LAYERS`` (with
    ``@LAYERS.register_module``) or one of ``torch.nn``.

    Raises:
        TypeError, NameError: as :func:`~kolossos.legacy.registry.build_from_registry`.
    """
    layer = build_from_registry(config, LAYERS)
    if not isinstance(layer, nn.Module):
        raise TypeError(
            f"layer config {config!r} built a {type(layer).__name__}, not an nn.Module."
        )
    return layer


class ModelFromConfig(nn.Module):
    """A model whose layers come from ``self.layers_cfg``, a list of ``dict(type=..., **kwargs)``.

    Subclass it, register the subclass with ``@MODELS.register_module`` and fill
    ``self.layers_cfg`` in ``__init__`` (after ``super().__init__()``). The layers are built into
    ``self.layers`` (an ``nn.ModuleList``) by :meth:`build_from_cfg`, or, one pipeline stage's
    range of them, by ``build_pipeline_model_from_cfg``. ``forward`` runs ``self.layers`` in
    order (the first gets the inputs; keyword inputs go to the first layer); override it for
    anything else.

    Attributes:
        layers_cfg: the layer configs, in execution order.
        layers: the built layers.
        layer_range: ``(start, end)``: which of ``layers_cfg`` ``layers`` holds.

    Example:
        >>> class Mlp(ModelFromConfig):
        ...     def __init__(self, width: int) -> None:
        ...         super().__init__()
        ...         self.layers_cfg = [dict(type="Linear", in_features=3, out_features=width),
        ...                            dict(type="ReLU"),
        ...                            dict(type="Linear", in_features=width, out_features=2)]
        >>> model = Mlp(8)
        >>> model.build_from_cfg()
        >>> len(model.layers), model.layer_range
        (3, (0, 3))
    """

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList()
        self.layers_cfg: list[dict[str, Any]] = []
        self.layer_range: tuple[int, int] = (0, 0)

    def build_from_cfg(self, start: int | None = None, end: int | None = None) -> None:
        """Build ``layers_cfg[start:end]`` (default: all) into ``self.layers``.

        Raises:
            ValueError: an empty or out-of-range ``[start, end)``.
        """
        n = len(self.layers_cfg)
        start = 0 if start is None else start
        end = n if end is None else end
        if not 0 <= start < end <= n:
            raise ValueError(
                f"layers [{start}, {end}) are out of range: {type(self).__name__}.layers_cfg has "
                f"{n} layer configs."
            )
        self.adopt_layers([build_layer(cfg) for cfg in self.layers_cfg[start:end]], start)

    def adopt_layers(self, layers: Sequence[nn.Module], start: int = 0) -> None:
        """Use already built ``layers`` (``layers_cfg[start:start + len(layers)]``)."""
        self.layers = nn.ModuleList(layers)
        self.layer_range = (start, start + len(layers))

    def init_weights(self) -> None:
        """Re-initialise the weights (upstream's hook; nothing by default)."""

    def state_dict_for_save_checkpoint(
        self, destination: Any = None, prefix: str = "", keep_vars: bool = False
    ) -> Any:
        """The state dict a checkpoint saves (``state_dict``, as upstream)."""
        return self.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run ``self.layers`` in order."""
        if not self.layers:
            raise RuntimeError(
                f"{type(self).__name__} has no layers: call build_from_cfg() (or build it with "
                "build_pipeline_model_from_cfg) first."
            )
        value = self.layers[0](*inputs, **kwargs)
        for layer in self.layers[1:]:
            value = layer(value)
        return value
