# Continue training a local LLaMA-family checkpoint on plain text (here: the bundled Shakespeare,
# tokenised once with the model's own tokenizer, cached, and packed into 64-token sequences).
#
#   python examples/make_tiny_models.py        # the tiny model (nothing is downloaded)
#   kolossos train examples/configs/llama_tiny_finetune.py
#   kolossos generate runs/tiny-llama-shakespeare --prompt "ROMEO." --tokens 40
#
# Point model.pretrained at any local Hugging Face causal LM folder (config.json, safetensors or
# .bin weights, tokenizer files) to fine-tune it instead.

name = "tiny-llama-shakespeare"
nproc_per_node = 2

plugin = "low_level_zero"  # ZeRO-2: optimizer states and gradients sharded over the 2 processes
plugin_kwargs = dict(stage=2)
mixed_precision = "fp32"

model = dict(pretrained="runs/tiny-models/llama", block_size=64)
data = dict(path=None, format="text", val_fraction=0.05)  # path=None: the bundled Shakespeare
train = dict(steps=60, batch_size=16, lr=3e-3, warmup_steps=6, eval_interval=20, eval_batches=2)
checkpoint = dict(every=20, keep_last=2)
sample = dict(tokens=40, prompt="ROMEO.\n", temperature=0.8)
export = True  # also write runs/tiny-llama-shakespeare/hf/ for transformers
