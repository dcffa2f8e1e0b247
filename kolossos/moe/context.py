"""``MOE_CONTEXT``: the process-wide MoE settings Colossal-AI keeps (its ``moe_env`` /
``MOE_CONTEXT``): the default expert-parallel layout new ``Experts`` take, the expert seed of
:func:`moe_set_seed`, and the auxiliary losses the MoE layers of one forward pass add for
:class:`~kolossos.moe.loss.MoeLoss` to collect.

``kolossos.launch(config=dict(parallel=dict(moe=dict(size=E))))`` fills the layout; without it
every expert lives on this rank (``ep_size`` 1). Outside the legacy path call
``MOE_CONTEXT.setup(ep_size)`` (creates the groups) or ``MOE_CONTEXT.set_parallel_info(info)``.
"""

from __future__ import annotations

import torch

from kolossos.moe.parallel_info import MoeParallelInfo, create_moe_groups, single_process_info

__all__ = ["MOE_CONTEXT", "MoeContext", "moe_set_seed"]


class MoeContext:
    """The MoE settings of this process (use the instance :data:`MOE_CONTEXT`).

    Example:
        >>> ctx = MoeContext()
        >>> ctx.parallel_info.ep_size
        1
        >>> ctx.add_loss(torch.tensor(0.5)); ctx.add_loss(torch.tensor(0.25))
        >>> float(ctx.get_loss())
        0.75
    """

    def __init__(self) -> None:
        self._info: MoeParallelInfo | None = None
        self.seed: int | None = None
        """The expert seed of :func:`moe_set_seed` (``None``: drawn from the global RNG)."""
        self._aux: list[torch.Tensor] = []
        self._z: list[torch.Tensor] = []

    # ------------------------------------------------------------------ layout
    @property
    def parallel_info(self) -> MoeParallelInfo:
        """The layout new ``Experts`` use (all experts local until one is set)."""
        return self._info if self._info is not None else single_process_info()

    @property
    def is_initialized(self) -> bool:
        """Whether a layout was set (by ``setup``, ``set_parallel_info`` or the launch)."""
        return self._info is not None

    def set_parallel_info(self, info: MoeParallelInfo | None) -> None:
        """Use ``info`` for the ``Experts`` built from now on (``None``: back to one rank)."""
        self._info = info

    def setup(self, ep_size: int, seed: int | None = None) -> MoeParallelInfo:
        """Create the documented groups for ``ep_size`` and make them the default
        (COLLECTIVE over the world); ``seed`` also calls :func:`moe_set_seed`."""
        self._info = create_moe_groups(ep_size)
        if seed is not None:
            self.seed = seed
        return self._info

    # ------------------------------------------------------------------ losses
    def reset_loss(self) -> None:
        """Forget the losses of an earlier forward pass (models call it first in ``forward``)."""
        self._aux.clear()
        self._z.clear()

    def add_loss(self, aux_loss: torch.Tensor, z_loss: torch.Tensor | None = None) -> None:
        """Record one layer's load-balancing loss (and router z-loss)."""
        self._aux.append(aux_loss)
        if z_loss is not None:
            self._z.append(z_loss)

    def get_loss(self) -> torch.Tensor | float:
        """The sum of the recorded load-balancing losses (``0.0`` when none)."""
        return torch.stack(self._aux).sum() if self._aux else 0.0

    def get_z_loss(self) -> torch.Tensor | float:
        """The sum of the recorded router z-losses (``0.0`` when none)."""
        return torch.stack(self._z).sum() if self._z else 0.0

    def pop_loss(self) -> torch.Tensor | float:
        """:meth:`get_loss`, then :meth:`reset_loss` (what ``MoeLoss`` does)."""
        loss = self.get_loss()
        self.reset_loss()
        return loss

    def reset(self) -> None:
        """Forget the layout, the seed and the losses."""
        self._info = None
        self.seed = None
        self.reset_loss()


#: the process-wide context (Colossal-AI's ``MOE_CONTEXT`` / ``moe_env``)
MOE_CONTEXT = MoeContext()


def moe_set_seed(seed: int) -> None:
    """Seed the experts: expert ``g`` (its global index) is initialised from ``seed + g``.

    Every rank of an expert-parallel group holds other experts, so their initial weights differ,
    as Colossal-AI's ``moe_set_seed`` promises; and since the seed follows the expert, not the
    rank, a model built at any expert-parallel size (a single process holding all experts
    included) starts from the same experts.

    Example:
        >>> moe_set_seed(42)
        >>> MOE_CONTEXT.seed
        42
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"moe_set_seed(seed={seed!r}): seed must be an int.")
    MOE_CONTEXT.seed = seed
