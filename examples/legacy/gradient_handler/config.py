"""Config of the "Gradient Handler" example: a user handler after ``DataParallelGradientHandler``.

``MyGradientHandler`` is registered in ``train.py`` (``@GRADIENT_HANDLER.register_module``) before
``kolossos.initialize`` builds the handlers by name. With handlers in the config, torch
``DistributedDataParallel`` is not used: ``DataParallelGradientHandler`` averages the gradients over
the data-parallel group instead. The sizes are small so that a run on CPUs takes seconds.
"""

BATCH_SIZE = 8  # per rank
NUM_EPOCHS = 1
STEPS_PER_EPOCH = 3  # iterations per epoch (0: the whole epoch)

gradient_handler = [dict(type="DataParallelGradientHandler"), dict(type="MyGradientHandler")]
