"""Config of the MoE WideNet example (Colossal-AI's "Integrate Mixture-of-Experts Into Your
Model" page), at a size that trains in seconds on CPUs.

``parallel.moe.size`` is the expert-parallel size: that many consecutive processes share out
the experts of every MoE layer (``ParallelMode.MOE_MODEL``), and the processes holding the same
experts form ``ParallelMode.MOE_DATA`` for the expert gradients. The data-parallel size is the
number of processes.
"""

MOE_MODEL_PARALLEL_SIZE = 2
parallel = dict(moe=dict(size=MOE_MODEL_PARALLEL_SIZE))

# hyper-parameters (the page's WideNet is ViT-B sized on ImageNet; tiny here)
NUM_EXPERTS = 4
CAPACITY_FACTOR = 1.2
BATCH_SIZE = 8  # per process
TRAIN_STEPS = 20
LEARNING_RATE = 3e-3
IMG_SIZE = 16
PATCH_SIZE = 4
NUM_CLASSES = 4
DEPTH = 2
D_MODEL = 32
NUM_HEADS = 4
D_KV = 8
D_FF = 64
DROP_RATE = 0.0
