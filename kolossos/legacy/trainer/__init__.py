"""Colossal-AI's legacy ``Trainer`` and its hooks (``colossalai.legacy.trainer``, also
``colossalai.trainer``; here ``kolossos.legacy.trainer`` and ``kolossos.trainer``).

Example:
    >>> from kolossos.legacy.trainer import Trainer, hooks
    >>> trainer = Trainer(engine=engine, logger=logger)
    >>> trainer.fit(train_dataloader=train_dataloader, epochs=NUM_EPOCHS,
    ...             test_dataloader=test_dataloader, test_interval=1,
    ...             hooks=[hooks.LossHook(), hooks.LogMetricByEpochHook(logger)],
    ...             display_progress=True)
"""

from kolossos.legacy.trainer import hooks
from kolossos.legacy.trainer.trainer import Trainer

__all__ = ["Trainer", "hooks"]
