"""AMP example config, ``AMP_TYPE.APEX``: NVIDIA apex (``opt_level='O1'``).

kolossos carries apex's options out with one of the other two recipes; a warning names it.

The tutorial's values are ``BATCH_SIZE = 128``, ``NUM_EPOCHS = 300`` and ViT-B/16 at 224x224; the
sizes here are small so that a run on CPUs takes seconds. ``IMG_SIZE`` to ``NUM_CLASSES`` are not in
the tutorial (it uses timm's ``vit_base_patch16_224``).
"""

from kolossos.amp import AMP_TYPE

BATCH_SIZE = 16  # per rank (tutorial: 128)
DROP_RATE = 0.1
NUM_EPOCHS = 3  # tutorial: 300

IMG_SIZE = 32  # ViT-B/16: 224
PATCH_SIZE = 8  # 16
HIDDEN_SIZE = 64  # 768
DEPTH = 2  # 12
NUM_HEADS = 4  # 12
NUM_CLASSES = 101  # Caltech101

fp16 = dict(
    mode=AMP_TYPE.APEX,
)

clip_grad_norm = 1.0
