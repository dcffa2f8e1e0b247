# The built-in character-level GPT-2 on the bundled Shakespeare, split two ways at once over 4
# processes: tensor parallelism (tp_size=2: every process holds half of each block's attention
# heads and MLP columns) times pipeline parallelism (pp_size=2: the first processes run the first
# half of the blocks, the others the second half, 1F1B over 4 micro-batches). tp x pp = 4, so the
# data-parallel size is 1 and every step trains on the whole global batch.
#
#   kolossos train examples/configs/gpt_hybrid_tp2_pp2.py           # 4 processes, CPU is fine
#   kolossos train examples/configs/gpt_hybrid_tp2_pp2.py --print-config
#
# Add plugin_kwargs.zero_stage=1 to shard the optimizer states over data-parallel replicas when
# there are more processes than tp x pp (e.g. --nproc_per_node 8 gives dp = 2).

name = "gpt-hybrid-tp2-pp2"
nproc_per_node = 4

plugin = "hybrid_parallel"
plugin_kwargs = dict(tp_size=2, pp_size=2, num_microbatches=4)
mixed_precision = "fp32"

model = dict(n_layer=4, n_head=4, n_embd=64, block_size=64)  # 2 blocks per stage, 2 heads per rank
train = dict(steps=60, batch_size=16, lr=3e-3, warmup_steps=6, eval_interval=20, eval_batches=2)
checkpoint = dict(every=30, keep_last=2)
sample = dict(tokens=120, prompt="ROMEO.\n")
