"""Config of the "Gradient Accumulation (Outdated)" example: ``gradient_accumulation = 4``.

The tutorial's example trains with ``BATCH_SIZE = 128`` for 200 epochs; the sizes here are small
so that a run on CPUs takes seconds (the script stops after one accumulation cycle anyway).
"""

BATCH_SIZE = 8  # per rank (tutorial: 128)
NUM_EPOCHS = 1  # tutorial: 200

gradient_accumulation = 4
