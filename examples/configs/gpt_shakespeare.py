# A kolossos train config in the style of Colossal-AI's config files: plain Python variables.
#
#   kolossos train examples/configs/gpt_shakespeare.py
#   kolossos train examples/configs/gpt_shakespeare.py train.steps=100 --nproc_per_node 4
#
# Lower-case names are configuration keys (every key is optional; see docs/getting-started.md
# for the full list and defaults). UPPER-CASE names are free hyper-parameters that you can reuse
# below; they are not keys themselves.

BLOCK_SIZE = 64
BATCH_SIZE = 64

name = "shakespeare-gpt-py"
seed = 1024
nproc_per_node = 2

# Any plugin of kolossos.booster.plugin.PLUGINS, with its keyword arguments.
plugin = "torch_ddp"
plugin_kwargs = dict(bucket_cap_mb=25)
mixed_precision = "fp32"  # or "bf16", "fp16"

model = dict(n_layer=4, n_head=4, n_embd=128, block_size=BLOCK_SIZE, dropout=0.0)
data = dict(path=None, tokenizer="char", val_fraction=0.1)  # path=None: bundled Shakespeare
train = dict(
    steps=250,
    batch_size=BATCH_SIZE,  # global: split over the data-parallel processes
    gradient_accumulation=1,
    lr=5e-3,
    warmup_steps=20,
    eval_interval=50,
)
checkpoint = dict(every=50, keep_last=2)
sample = dict(tokens=300, prompt="OTHELLO.\n", temperature=0.8)
