"""Config of the sequence-parallel BERT example (Colossal-AI's ``examples/tutorial/
sequence_parallel``), at a size that trains in seconds on CPUs.

``parallel.tensor`` with ``mode="sequence"`` builds ``ParallelMode.SEQUENCE`` (the ranks that
split each sequence) and ``ParallelMode.SEQUENCE_DP`` (every rank of the stage: the gradient
all-reduce). On 2 processes: sequence size 2; on 4: sequence 2 × data 2.
"""

# hyper-parameters
TRAIN_ITERS = 20
GLOBAL_BATCH_SIZE = 8  # data-parallel size * sentences per data-parallel replica
LR = 2e-3
WEIGHT_DECAY = 0.01
SEQ_LENGTH = 64  # split over the sequence-parallel ranks
MASKED_PER_SAMPLE = 8  # masked-LM targets per sentence

# BERT config
DEPTH = 2
NUM_ATTENTION_HEADS = 4
HIDDEN_SIZE = 64
VOCAB_SIZE = 128

# random seed
SEED = 1234

# kolossos config
parallel = dict(pipeline=1, tensor=dict(size=2, mode="sequence"))

gradient_handler = [dict(type="SequenceParallelGradientHandler")]
