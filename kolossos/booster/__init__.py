"""The Booster API: :class:`Booster`, plugins (:mod:`kolossos.booster.plugin`) and mixed
precision (:mod:`kolossos.booster.mixed_precision`)."""

from kolossos.booster.booster import Booster

__all__ = ["Booster"]
