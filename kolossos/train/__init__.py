"""``kolossos train``: configuration-file based training of a GPT model over the Booster.

The pieces, one per module: :mod:`.config` (typed sections), :mod:`.schema` and
:mod:`.config_files` (files and ``key=value`` overrides to a validated config), :mod:`.plugins`
(plugin registry, keyword and layout checks), :mod:`.data` (corpus, tokenizers, deterministic
batches), :mod:`.model` (GPT-2 from ``transformers``), :mod:`.setup` (building and boosting),
:mod:`.loop` (the training loop), :mod:`.checkpoints`, :mod:`.metrics`, :mod:`.plot`,
:mod:`.progress`, :mod:`.report`, :mod:`.prelaunch` and :mod:`.worker` (the per-rank entry point).

Example:
    >>> from kolossos.train import load_config
    >>> config = load_config("examples/configs/gpt_shakespeare.toml", ["train.steps=50"])
    ... # doctest: +SKIP
"""

from kolossos.train.config import TrainConfig
from kolossos.train.config_files import load_config
from kolossos.train.errors import ConfigError

__all__ = ["ConfigError", "TrainConfig", "load_config"]
