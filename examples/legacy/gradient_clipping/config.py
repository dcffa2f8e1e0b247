"""Config of the "Gradient Clipping (Outdated)" example: ``clip_grad_norm = 1.0``.

The sizes are small so that a run on CPUs takes seconds (the tutorial's example trains a ResNet-34
with ``BATCH_SIZE = 128``).
"""

BATCH_SIZE = 8  # per rank (tutorial: 128)
NUM_EPOCHS = 1  # tutorial: 200
STEPS_PER_EPOCH = 3  # not in the tutorial: iterations per epoch (0: the whole epoch)

clip_grad_norm = 1.0
