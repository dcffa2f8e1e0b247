"""Sequence parallelism with the legacy engine: Colossal-AI's BERT tutorial
(``examples/tutorial/sequence_parallel``) at a size that trains in seconds on CPUs.

``config.py`` asks for ``parallel = dict(tensor=dict(size=2, mode="sequence"))``: every
sentence is split into 2 chunks of tokens, one per rank, and ring self-attention
(``TransformerSelfAttentionRing``) passes the keys and values of the chunks around the ring so
that every token still attends to the whole sentence. ``SequenceParallelGradientHandler``
averages the gradients over ``ParallelMode.SEQUENCE_DP``. Run::

    kolossos run --nproc_per_node 2 examples/legacy/sequence_parallel/train.py \\
        --config examples/legacy/sequence_parallel/config.py

(4 processes: sequence 2 × data 2.) Changes from the tutorial: imports from ``kolossos``;
synthetic masked-LM data generated identically on every rank (instead of a broadcast from the
first rank of the tensor group); no sentence-order head, no fp16 (CPU) and no lr scheduler; the
loss is the exact masked-LM mean over whole sentences (``loss.py``) and the ring gradients are
exact, so the run trains the same model as one process would (``tests/parity/
test_legacy_sequence_parallel.py``). The exit code is 1 if the loss did not fall or the ranks end
with different parameters.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # data.py, loss.py, model.py next to this file

from data import get_batch_for_sequence_parallel, synthetic_batch  # noqa: E402
from loss import BertLoss  # noqa: E402
from model import BertForPretrain  # noqa: E402

import kolossos  # noqa: E402
from kolossos.context import ParallelMode  # noqa: E402
from kolossos.core import global_context as gpc  # noqa: E402
from kolossos.logging import get_dist_logger  # noqa: E402


def same_on_all_ranks(model: torch.nn.Module) -> bool:
    """Whether every parameter is bitwise identical on every rank of SEQUENCE_DP (collective)."""
    group = gpc.get_group(ParallelMode.SEQUENCE_DP)
    local = torch.cat([p.detach().flatten() for p in model.parameters()])
    reference = local.clone()
    dist.broadcast(reference, src=gpc.get_ranks_in_group(ParallelMode.SEQUENCE_DP)[0], group=group)
    agree = torch.tensor([float(torch.equal(local, reference))])
    dist.all_reduce(agree, op=dist.ReduceOp.MIN, group=group)
    return bool(agree.item())


def main() -> int:
    """Train ``TRAIN_ITERS`` steps; fail if the loss did not fall or the ranks disagree."""
    parser = kolossos.get_default_parser()
    parser.set_defaults(config=str(HERE / "config.py"))
    args = parser.parse_args()
    kolossos.launch_from_torch(config=args.config, seed=1234)
    cfg = gpc.config
    logger = get_dist_logger()
    sp_size, sp_rank = (
        gpc.get_world_size(ParallelMode.SEQUENCE),
        gpc.get_local_rank(ParallelMode.SEQUENCE),
    )
    dp_size, dp_rank = gpc.get_world_size(ParallelMode.DATA), gpc.get_local_rank(ParallelMode.DATA)
    logger.info(f"sequence parallel size {sp_size}, data parallel size {dp_size}", ranks=[0])

    torch.manual_seed(cfg.SEED)
    model = BertForPretrain(
        vocab_size=cfg.VOCAB_SIZE,
        hidden_size=cfg.HIDDEN_SIZE,
        max_sequence_length=cfg.SEQ_LENGTH,
        num_attention_heads=cfg.NUM_ATTENTION_HEADS,
        num_layers=cfg.DEPTH,
    )
    logger.info(
        f"This model has {sum(p.numel() for p in model.parameters())} parameters", ranks=[0]
    )
    criterion = BertLoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.LR, weight_decay=cfg.WEIGHT_DECAY)
    engine, *_ = kolossos.initialize(model, optimizer, criterion, verbose=False)
    handlers = [type(h).__name__ for h in engine.gradient_handlers]
    logger.info(f"gradient handlers: {handlers}", ranks=[0])

    losses = []
    engine.train()
    for step in range(1, cfg.TRAIN_ITERS + 1):
        batch = synthetic_batch(step, cfg.GLOBAL_BATCH_SIZE, cfg.SEQ_LENGTH, cfg.VOCAB_SIZE,
                                cfg.MASKED_PER_SAMPLE, cfg.SEED)  # fmt: skip
        tokens, labels, padding_mask = get_batch_for_sequence_parallel(
            batch, dp_rank, dp_size, sp_rank, sp_size
        )
        engine.zero_grad()
        logits = engine(tokens, padding_mask)
        train_loss = engine.criterion(logits, labels)
        engine.backward(train_loss)
        engine.step()
        # each rank holds its chunk's share (times P): the mean over all ranks is the loss
        reported = train_loss.detach().reshape(1).clone()
        dist.all_reduce(reported)
        losses.append(reported.item() / dist.get_world_size())
        logger.info(f"step {step} / {cfg.TRAIN_ITERS} | train loss {losses[-1]:.6f}", ranks=[0])

    agree = same_on_all_ranks(model)
    fell = losses[-1] < 0.8 * losses[0]
    logger.info(f"parameters identical on all ranks: {agree}; loss fell: {fell}", ranks=[0])
    dist.destroy_process_group()
    return 0 if agree and fell else 1


if __name__ == "__main__":
    sys.exit(main())
