"""The tutorial's config file ("Use Engine and Trainer in Training", step 1), at small sizes.

The tutorial has ``BATCH_SIZE = 128`` and ``NUM_EPOCHS = 200``; here the sizes are small so that
the example runs in seconds on a CPU. Copy the file and raise them for a real run.
"""

from kolossos.amp import AMP_TYPE

BATCH_SIZE = 4  # per process (tutorial: 128)
NUM_EPOCHS = 2  # tutorial: 200

fp16 = dict(mode=AMP_TYPE.TORCH)
