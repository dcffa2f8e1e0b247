# Instruction fine-tuning from JSON Lines: each line holds a "prompt" and a "response"; the
# prompt's tokens are masked out of the loss (label -100), so the model learns the answers only.
#
#   python examples/make_tiny_models.py        # the tiny model and the JSONL file
#   kolossos train examples/configs/llama_tiny_instruct.py
#   kolossos export runs/tiny-llama-instruct runs/tiny-llama-instruct-hf

name = "tiny-llama-instruct"
nproc_per_node = 2

plugin = "torch_ddp"
mixed_precision = "fp32"

model = dict(pretrained="runs/tiny-models/llama", block_size=64)
data = dict(
    path="runs/tiny-models/instructions.jsonl",
    format="instruction",
    prompt_field="prompt",
    response_field="response",
)
train = dict(steps=40, batch_size=16, lr=3e-3, warmup_steps=4, eval_interval=20, eval_batches=2)
checkpoint = dict(every=20, keep_last=1)
sample = dict(tokens=20, prompt="Complete the line: To be, or not to be,\n")
