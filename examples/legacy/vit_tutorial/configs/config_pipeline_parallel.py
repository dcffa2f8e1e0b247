"""The ViT tutorial's pipeline config (``hybrid_parallel/configs/vit_pipeline.py``), at small
sizes (the tutorial's values in the comments). The tutorial's snippet uses ``BATCH_SIZE`` before
defining it; here the hyper-parameters come first."""

from kolossos.amp import AMP_TYPE

# hyper parameters
# BATCH_SIZE is as per GPU
# global batch size = BATCH_SIZE x data parallel size
BATCH_SIZE = 8  # 256
LEARNING_RATE = 3e-3
WEIGHT_DECAY = 0.3
NUM_EPOCHS = 2  # 300
WARMUP_EPOCHS = 1  # 32

# model config
IMG_SIZE = 32  # 224
PATCH_SIZE = 8  # 16
HIDDEN_SIZE = 32  # 768
DEPTH = 4  # 12
NUM_HEADS = 4  # 12
MLP_RATIO = 2  # 4
NUM_CLASSES = 10
CHECKPOINT = True
SEQ_LENGTH = (IMG_SIZE // PATCH_SIZE) ** 2 + 1  # add 1 for cls token
TRAIN_SIZE = 32  # synthetic CIFAR-10 stand-in when $DATA holds no CIFAR-10

parallel = dict(
    pipeline=2,
)

# pipeline config
NUM_MICRO_BATCHES = parallel["pipeline"]
TENSOR_SHAPE = (BATCH_SIZE // NUM_MICRO_BATCHES, SEQ_LENGTH, HIDDEN_SIZE)

fp16 = dict(mode=AMP_TYPE.NAIVE, initial_scale=2**10)  # kolossos: a short run's scale
clip_grad_norm = 1.0
