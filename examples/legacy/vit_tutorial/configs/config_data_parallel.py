"""The ViT tutorial's data-parallel config (``data_parallel/config.py``), at small sizes.

Tutorial values: ``BATCH_SIZE = 256``, ``NUM_EPOCHS = 300``, ``gradient_accumulation = 16`` and
timm's ViT-B/16 at 224x224. ``NUM_CLASSES`` (read by the tutorial's script but missing from its
config) and the model sizes below it are this example's additions.
"""

from kolossos.amp import AMP_TYPE

# ViT Base
BATCH_SIZE = 4  # per process (tutorial: 256)
DROP_RATE = 0.1
NUM_EPOCHS = 2  # tutorial: 300

# mix precision
fp16 = dict(
    mode=AMP_TYPE.TORCH,
)

gradient_accumulation = 2  # tutorial: 16
clip_grad_norm = 1.0

dali = dict(  # read by the tutorial's DALI loader only (not used here)
    gpu_aug=True,
    mixup_alpha=0.2,
)

NUM_CLASSES = 10
IMG_SIZE = 32  # ViT-B/16: 224
PATCH_SIZE = 8  # 16
HIDDEN_SIZE = 32  # 768
DEPTH = 2  # 12
NUM_HEADS = 4  # 12
TRAIN_SIZE = 64  # synthetic CIFAR-10 stand-in when $DATA holds no CIFAR-10
