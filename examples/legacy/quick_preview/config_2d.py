"""Config of the quick-preview example: 2D tensor parallelism over 4 processes (the README's).

The README's MLP has widths 1024 -> 16384 -> 1024; the widths here are small so that a run on CPUs
takes seconds.
"""

parallel = dict(tensor=dict(size=4, mode="2d"))

BATCH_SIZE = 16
NUM_EPOCHS = 4
NUM_SAMPLES = 256  # synthetic samples
IN_FEATURES = 64  # README: 1024
HIDDEN_FEATURES = 256  # README: 16384
