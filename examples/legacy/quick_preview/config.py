"""Config of the quick-preview example: 1D tensor parallelism over 2 processes.

The README's MLP has widths 1024 -> 16384 -> 1024; the widths here are small so that a run on CPUs
takes seconds.
"""

parallel = dict(tensor=dict(size=2, mode="1d"))

BATCH_SIZE = 16
NUM_EPOCHS = 4
NUM_SAMPLES = 256  # synthetic samples
IN_FEATURES = 64  # README: 1024
HIDDEN_FEATURES = 256  # README: 16384
