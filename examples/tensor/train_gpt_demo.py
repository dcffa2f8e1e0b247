"""GPT-2 with ColoTensor tensor parallelism and Gemini (the documents' "ZeRO with chunk-based
memory management + TP" GPT-2 example, and the Megatron-style GPT-2 via ColoTensor).

The model is built under ``ColoInitContext(device, dtype, default_dist_spec, default_pg)``
(``--shardinit``: every parameter cut on its last dimension at build time), sharded by the
documents' ``tensor_parallelize`` recipe (``gpt2_tp_recipe.py``) over ``ProcessGroup(tp_degree=
--tp_degree)``, then trained on random tokens, printing loss, step time and TFLOPS per step.

``--distplan CAI_Gemini`` (default) wraps the model in ``GeminiDDP(placement_policy=--placement,
pin_memory=True, search_range_mb=32)`` with ``GeminiAdamOptimizer(lr=1e-3, initial_scale=2**5)``
and ``optimizer.backward(loss)``; Gemini's chunks hold the tensor-parallel pieces and are
data-parallel over the ProcessGroup's dp group. ``--distplan colo_tp`` trains the ColoParameters
with ``torch.optim.Adam`` instead, averaging gradients over the dp group by hand.

Run (CPU, small)::

    kolossos run --nproc_per_node 2 examples/tensor/train_gpt_demo.py --placement cpu
    kolossos run --nproc_per_node 4 examples/tensor/train_gpt_demo.py --tp_degree 2 --shardinit
    kolossos run --nproc_per_node 4 examples/tensor/train_gpt_demo.py --distplan colo_tp \\
        --tp_degree 2

Changes from the documents: imports from ``kolossos``; ``--model_type`` adds ``gpt2_tiny`` (2
layers, hidden 64; default) next to ``gpt2_medium``; ``--batch_size``, ``--seq_len``,
``--num_steps`` flags (documents: 8, 1024, 10); fp32 on CPU (documents: fp16 on CUDA); the
``colo_tp`` plan is new.
"""

import os
import sys
import time

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

import kolossos
from kolossos.nn.parallel import GeminiAdamOptimizer, GeminiDDP
from kolossos.tensor import ProcessGroup, ShardSpec
from kolossos.utils import get_current_device, print_rank_0
from kolossos.utils.model.colo_init_context import ColoInitContext

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt2_tp_recipe import tensor_parallelize

MODELS = {
    "gpt2_tiny": dict(n_embd=64, n_layer=2, n_head=4),
    "gpt2_medium": dict(n_embd=1024, n_layer=24, n_head=16),
}


def parse_args():
    parser = kolossos.get_default_parser()
    parser.add_argument(
        "--distplan", type=str, default="CAI_Gemini", choices=["CAI_Gemini", "colo_tp"]
    )
    parser.add_argument("--tp_degree", type=int, default=1, help="Tensor Parallelism Degree.")
    parser.add_argument("--placement", type=str, default="cpu", help="Placement Policy for Gemini.")
    parser.add_argument(
        "--shardinit", action="store_true", help="Shard the tensors when init the model."
    )
    parser.add_argument("--model_type", type=str, default="gpt2_tiny", choices=sorted(MODELS))
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=32)
    parser.add_argument("--vocab_size", type=int, default=50257)
    parser.add_argument("--num_steps", type=int, default=4)
    return parser.parse_args()


class GPTLMModel(torch.nn.Module):
    def __init__(self, model_type, vocab_size, seq_len, checkpoint=False):
        super().__init__()
        config = GPT2Config(vocab_size=vocab_size, n_positions=seq_len, **MODELS[model_type])
        config._attn_implementation = "eager"
        self.model = GPT2LMHeadModel(config)
        if checkpoint:
            self.model.gradient_checkpointing_enable()

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)[0]


class GPTLMLoss(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.loss_fn = torch.nn.CrossEntropyLoss()

    def forward(self, logits, labels):
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        return self.loss_fn(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))


def get_tflops(model_numel, batch_size, seq_len, step_time):
    return model_numel * batch_size * seq_len * 8 / 1e12 / (step_time + 1e-12)


def main():
    args = parse_args()
    kolossos.launch_from_torch(config={})
    world_size = dist.get_world_size()

    default_pg = ProcessGroup(tp_degree=args.tp_degree)
    default_dist_spec = ShardSpec([-1], [args.tp_degree]) if args.shardinit else None
    torch.manual_seed(123)
    with ColoInitContext(
        device=get_current_device(),
        dtype=torch.float,
        default_dist_spec=default_dist_spec,
        default_pg=default_pg,
    ):
        model = GPTLMModel(args.model_type, args.vocab_size, args.seq_len, checkpoint=False)
    numel = sum(
        p.numel() for p in model.parameters()
    )  # global sizes (ColoTensor shapes are global)
    tp_pg = ProcessGroup(tp_degree=args.tp_degree)
    tensor_parallelize(model, tp_pg)
    print_rank_0(
        f"{args.model_type}: {numel / 1e6:.2f} M parameters, tp {args.tp_degree}, "
        f"world {world_size}"
    )

    if args.distplan == "CAI_Gemini":
        model = GeminiDDP(
            model,
            device=get_current_device(),
            placement_policy=args.placement,
            pin_memory=True,
            search_range_mb=32,
        )
        optimizer = GeminiAdamOptimizer(model, lr=1e-3, initial_scale=2**5)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    criterion = GPTLMLoss()
    gen = torch.Generator().manual_seed(tp_pg.dp_local_rank())
    tflops = []
    for n in range(args.num_steps):
        input_ids = torch.randint(
            0, args.vocab_size, (args.batch_size, args.seq_len), generator=gen
        )
        attn_mask = torch.ones_like(input_ids)
        start = time.time()
        optimizer.zero_grad()
        outputs = model(input_ids, attn_mask)
        loss = criterion(outputs, input_ids)
        if args.distplan == "CAI_Gemini":
            optimizer.backward(loss)
        else:
            loss.backward()
            for p in model.parameters():  # data parallelism over the dp group
                dist.all_reduce(p.grad.to_local(), group=tp_pg.dp_process_group())
                p.grad.to_local().div_(tp_pg.dp_world_size())
        optimizer.step()
        step_time = time.time() - start
        value = loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item()
        step_tflops = get_tflops(numel, args.batch_size, args.seq_len, step_time)
        tflops.append(step_tflops)
        print_rank_0(
            f"[{n + 1}/{args.num_steps}] Loss:{value:.3f}, Step time: {step_time:.3f}s, "
            f"TFLOPS: {step_tflops:.6f}"
        )
    tflops.sort()
    print_rank_0(f"Median TFLOPS is {tflops[len(tflops) // 2]:.6f}")


if __name__ == "__main__":
    main()
