"""GPT with hybrid parallelism (pipeline, or pipeline x 1D tensor) and a hand-split model: the
"Train GPT Using Hybrid Parallelism" tutorial, at small size.

Run (``$DATA``: the loose-JSON web-text file; without it a small stand-in is written to
``./data/webtext/train.json``)::

    kolossos run --nproc_per_node 2 examples/legacy/gpt_hybrid/train_gpt.py  # PP 2
    kolossos run --nproc_per_node 4 examples/legacy/gpt_hybrid/train_gpt.py --tp 2  # PP2 x TP2
    kolossos run --nproc_per_node 2 examples/legacy/gpt_hybrid/train_gpt.py --num_chunks 2

Changes from the tutorial: imports from ``kolossos`` (``model_zoo.gpt`` is
``kolossos.model_zoo.gpt``); sizes (``NUM_LAYERS`` .. ``BATCH_SIZE`` below; the tutorial's
GPT-2 XL is 48 layers of width 1600 with 32 heads, batch 192, sequence 1024, 60 epochs) and
``GPT2_exlarge_pipeline_hybrid`` reads them; the model is fp32 with no ``fp16`` entry on a CPU
(CPUs have no fast half matmuls; with CUDA the tutorial's ``dtype=torch.half`` and
``fp16=dict(mode=AMP_TYPE.NAIVE)`` are used); ``--tp`` picks the pipeline-only or the
pipeline + 1D tensor config and ``--num_chunks`` sets ``NUM_CHUNKS`` (interleaved; it is also put
into ``CONFIG``, which selects the interleaved schedule); ``GPT2Tokenizer.from_pretrained('gpt2')``
became ``kolossos.legacy.data.gpt2_tokenizer()`` (local files, no hub); the build functions'
``device`` defaults to the current device; ``build_gpt_pipeline`` ties the embedding and head
in place when one rank holds both. The script exits with 1 unless every logged loss is finite.
"""

import math
import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn import functional as F

import kolossos
import kolossos.model_zoo.gpt.gpt as col_gpt
import kolossos.utils as utils
from kolossos import nn as col_nn
from kolossos.amp import AMP_TYPE
from kolossos.builder.pipeline import partition_uniform
from kolossos.context.parallel_mode import ParallelMode
from kolossos.core import global_context as gpc
from kolossos.engine.schedule import InterleavedPipelineSchedule, PipelineSchedule  # noqa: F401
from kolossos.legacy.data import WebtextDataset, write_sample_webtext
from kolossos.logging import disable_existing_loggers, get_dist_logger
from kolossos.model_zoo.gpt import GPTLMLoss
from kolossos.nn.layer.wrapper import PipelineSharedModuleWrapper
from kolossos.trainer import Trainer, hooks
from kolossos.utils.timer import MultiTimer

NUM_LAYERS = 4  # 48
HIDDEN_SIZE = 32  # 1600
NUM_HEADS = 4  # 32
NUM_EPOCHS = 2  # 60
SEQ_LEN = 16  # 1024
BATCH_SIZE = 4  # 192
SAMPLE_DOCS = 32  # documents of the stand-in data set


class PipelineGPTHybrid(nn.Module):
    def __init__(
        self,
        num_layers: int = 12,
        hidden_size: int = 768,
        num_attention_heads: int = 12,
        vocab_size: int = 50304,
        embed_drop_rate: float = 0.0,
        act_func: Callable = F.gelu,
        mlp_ratio: int = 4,
        attn_drop_rate: float = 0.0,
        drop_rate: float = 0.0,
        dtype: torch.dtype = torch.float,
        checkpoint: bool = False,
        max_position_embeddings: int = 1024,
        layer_norm_epsilon: float = 1e-5,
        first: bool = False,
        last: bool = False,
    ):
        super().__init__()
        self.embedding = None
        self.norm = None
        self.head = None
        if first:
            self.embedding = col_gpt.GPTEmbedding(
                hidden_size,
                vocab_size,
                max_position_embeddings,
                dropout=embed_drop_rate,
                dtype=dtype,
            )
        self.blocks = nn.ModuleList(
            [
                col_gpt.GPTBlock(
                    hidden_size,
                    num_attention_heads,
                    mlp_ratio=mlp_ratio,
                    attention_dropout=attn_drop_rate,
                    dropout=drop_rate,
                    dtype=dtype,
                    checkpoint=checkpoint,
                    activation=act_func,
                )
                for _ in range(num_layers)
            ]
        )
        if last:
            self.norm = col_nn.LayerNorm(hidden_size, eps=layer_norm_epsilon)
            self.head = col_gpt.GPTLMHead(
                vocab_size=vocab_size, dim=hidden_size, dtype=dtype, bias=False
            )

    def forward(self, hidden_states=None, input_ids=None, attention_mask=None):
        if self.embedding is not None:
            hidden_states = self.embedding(input_ids=input_ids)
        batch_size = hidden_states.shape[0]
        attention_mask = attention_mask.view(batch_size, -1)
        attention_mask = attention_mask[:, None, None, :]
        attention_mask = attention_mask.to(dtype=hidden_states.dtype)  # fp16 compatibility
        attention_mask = (1.0 - attention_mask) * -10000.0
        for block in self.blocks:
            hidden_states, attention_mask = block(hidden_states, attention_mask)
        if self.norm is not None:
            hidden_states = self.head(self.norm(hidden_states))
        return hidden_states


def build_gpt_pipeline(num_layers, num_chunks, device=None, **kwargs):
    device = utils.get_current_device() if device is None else device
    logger = get_dist_logger()
    pipeline_size = gpc.get_world_size(ParallelMode.PIPELINE)
    pipeline_rank = gpc.get_local_rank(ParallelMode.PIPELINE)
    rank = gpc.get_global_rank()
    wrapper = PipelineSharedModuleWrapper([0, pipeline_size - 1])
    parts = partition_uniform(num_layers, pipeline_size, num_chunks)[pipeline_rank]
    models = []
    for start, end in parts:
        kwargs["num_layers"] = end - start
        kwargs["first"] = start == 0
        kwargs["last"] = end == num_layers
        logger.info(f"Rank{rank} build layer {start}-{end}, {end - start}/{num_layers} layers")
        chunk = PipelineGPTHybrid(**kwargs).to(device)
        if start == 0:
            wrapper.register_module(chunk.embedding.word_embeddings)
        elif end == num_layers:
            wrapper.register_module(chunk.head)
        models.append(chunk)
    if len(models) == 1:  # noqa: SIM108  (as the tutorial writes it)
        model = models[0]
    else:
        model = nn.ModuleList(models)
    return model


def GPT2_exlarge_pipeline_hybrid(num_chunks=1, checkpoint=False, dtype=torch.float):
    cfg = dict(
        hidden_size=HIDDEN_SIZE,
        num_attention_heads=NUM_HEADS,
        checkpoint=checkpoint,
        dtype=dtype,
        max_position_embeddings=SEQ_LEN,
    )
    return build_gpt_pipeline(NUM_LAYERS, num_chunks, **cfg)


class WebtextDataset(WebtextDataset):
    """The tutorial's dataset (loose JSON -> GPT-2 tokens, cached as gpt_webtext_{seq_len}.pt)."""


def data_path():
    """``$DATA``, or a stand-in written from the bundled Shakespeare text."""
    path = os.environ.get("DATA")
    if path and os.path.isfile(path):
        return path
    return str(write_sample_webtext("./data/webtext/train.json", num_docs=SAMPLE_DOCS))


def make_config(tp, num_chunks):
    half = torch.cuda.is_available()
    config = dict(NUM_MICRO_BATCHES=BATCH_SIZE, parallel=dict(pipeline=2))
    if tp > 1:  # pipeline + 1D model parallel
        config["parallel"]["tensor"] = dict(mode="1d", size=tp)
    if half:
        config["fp16"] = dict(mode=AMP_TYPE.NAIVE)
    if num_chunks is not None:
        config["NUM_CHUNKS"] = num_chunks
    config["TENSOR_SHAPE"] = (BATCH_SIZE // BATCH_SIZE, SEQ_LEN, HIDDEN_SIZE)
    return config, torch.half if half else torch.float


def train():
    disable_existing_loggers()
    parser = kolossos.get_default_parser()
    parser.add_argument("--tp", type=int, default=1, help="1D tensor-parallel size")
    parser.add_argument("--num_chunks", type=int, default=None, help="NUM_CHUNKS (interleaved)")
    args = parser.parse_args()
    CONFIG, dtype = make_config(args.tp, args.num_chunks)
    NUM_CHUNKS = args.num_chunks
    kolossos.launch_from_torch(config=CONFIG, backend=args.backend)
    logger = get_dist_logger()

    train_ds = WebtextDataset(data_path(), seq_len=SEQ_LEN)
    train_dataloader = utils.get_dataloader(
        train_ds, seed=42, batch_size=BATCH_SIZE, pin_memory=True, shuffle=True, drop_last=True
    )

    use_interleaved = NUM_CHUNKS is not None
    num_chunks = 1 if not use_interleaved else NUM_CHUNKS
    model = GPT2_exlarge_pipeline_hybrid(num_chunks=num_chunks, checkpoint=True, dtype=dtype)
    # model = GPT3_pipeline_hybrid(num_chunks=num_chunks, checkpoint=True, dtype=torch.half)
    if use_interleaved and not isinstance(model, nn.ModuleList):
        model = nn.ModuleList([model])

    criterion = GPTLMLoss()

    optimizer = torch.optim.Adam(model.parameters(), lr=0.00015, weight_decay=1e-2)

    engine, train_dataloader, _, _ = kolossos.initialize(
        model, optimizer, criterion, train_dataloader=train_dataloader
    )
    global_batch_size = (
        BATCH_SIZE
        * gpc.get_world_size(ParallelMode.DATA)
        * getattr(gpc.config, "gradient_accumulation", 1)
    )
    logger.info(f"Init done, global batch size = {global_batch_size}", ranks=[0])
    logger.info(f"schedule: {type(engine.schedule).__name__}", ranks=[0])

    timer = MultiTimer()

    trainer = Trainer(engine=engine, logger=logger, timer=timer)

    hook_list = [
        hooks.LossHook(),
        hooks.LogMetricByEpochHook(logger),
        hooks.ThroughputHook(),
        hooks.LogMetricByStepHook(),
    ]

    trainer.fit(
        train_dataloader=train_dataloader,
        epochs=NUM_EPOCHS,
        test_interval=1,
        hooks=hook_list,
        display_progress=True,
        return_output_label=False,
    )

    # kolossos: the last stage's epoch loss must be finite
    ok = True
    if gpc.is_last_rank(ParallelMode.PIPELINE):
        loss = float(trainer.states["metrics"]["train"]["Loss"].get_accumulated_value())
        ok = math.isfinite(loss)
        print(f"[rank {dist.get_rank()}] final train loss {loss:.4f}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(train())
