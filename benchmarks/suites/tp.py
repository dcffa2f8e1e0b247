"""TP suite: ``HybridParallelPlugin`` tensor parallelism (with and without sequence parallelism)
against PyTorch's DTensor tensor parallelism on the same GPT-2, and against data parallelism
(the plugin at ``tp_size=1``, raw DDP) and one process.

Tensor parallelism runs over all ranks of the job (``tp = world size``, default 2). To compare
rows at the same global batch, a TP group trains on the concatenation of its ranks' batches (the
token ids are all-gathered first, a few KB): every row processes ``world size x batch`` samples
per step, so tokens/s and per-rank peak memory compare directly.

Both TP rows shard the same layers: attention (fused q/k/v column-parallel, output projection
row-parallel), MLP (column, row), the token embedding and the tied LM head (vocabulary-parallel);
position embeddings and layer norms stay replicated. Both gather the full logits for the loss
(kolossos: ``parallel_output=False``), so the loss is computed identically. Under
``--precision bf16`` the plugin keeps bf16 weights with fp32 masters (its ``precision='bf16'``)
while the torch rows use bf16 autocast over fp32 weights.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from benchmarks.contenders import Contender, Context, Setup, native_contenders
from benchmarks.suites import Suite


def _group_batch(x: torch.Tensor) -> torch.Tensor:
    """The concatenation of every rank's ``x`` (the TP group spans the whole job)."""
    world = dist.get_world_size()
    if world == 1:
        return x
    flat = torch.empty(world * x.numel(), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(flat, x.contiguous().view(-1))
    return flat.view(world * x.shape[0], *x.shape[1:])


def _hf(model: nn.Module) -> Any:
    inner = getattr(model, "model", None)
    if not isinstance(inner, nn.Module) or not hasattr(inner, "transformer"):
        raise TypeError("the HybridParallelPlugin rows run GPT-2 models only (--model gpt2-*)")
    return inner


class KolossosHybrid(Contender):
    """``HybridParallelPlugin`` through the Booster."""

    role = "kolossos"

    def __init__(
        self,
        name: str,
        tp: bool,
        sp: bool,
        counterpart: str,
        description: str,
        options: dict[str, Any] | None = None,
    ) -> None:
        self.name, self.tp, self.sp = name, tp, sp
        # split_gather sequence parallelism shards along the TP group: two ranks at least
        self.min_world = 2 if sp else 1
        self.counterpart, self.description = counterpart, description
        self.options = dict(options or {})
        """further ``HybridParallelPlugin`` keywords (e.g. ``enable_all_optimization``)"""
        # model states split over the ranks (TP) or replicated (DP)
        self.strategy = "zero3" if tp else "ddp"

    def setup(self, model: nn.Module, ctx: Context) -> Setup:
        from kolossos.booster import Booster
        from kolossos.booster.plugin import HybridParallelPlugin

        hf = _hf(model)
        plugin = HybridParallelPlugin(
            tp_size=dist.get_world_size() if self.tp else 1,
            precision="bf16" if ctx.precision == "bf16" else "fp32",
            enable_sequence_parallelism=self.sp,
            parallel_output=False,
            **self.options,
        )
        booster = Booster(plugin=plugin)
        boosted, opt, _, _, _ = booster.boost(hf, ctx.adam(hf.parameters()))
        assert opt is not None
        gather = _group_batch if self.tp else (lambda t: t)

        def forward_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits = boosted(input_ids=gather(x), use_cache=False).logits
            return ctx.spec.loss(logits, gather(y))

        return Setup(
            forward_loss=forward_loss,
            backward=lambda loss: booster.backward(loss, opt),
            step=opt.step,
            zero_grad=lambda: opt.zero_grad(set_to_none=True),
            track=[hf, opt.unwrap()],
        )


def _linear_from_conv1d(conv: Any, rows: torch.Tensor | None = None) -> nn.Linear:
    """transformers' ``Conv1D`` (weight ``(in, out)``) as an ``nn.Linear``, output rows
    optionally permuted."""
    weight, bias = conv.weight.detach().t(), conv.bias.detach()
    if rows is not None:
        weight, bias = weight[rows], bias[rows]
    linear = nn.Linear(weight.shape[1], weight.shape[0], device=weight.device)
    with torch.no_grad():
        linear.weight.copy_(weight)
        linear.bias.copy_(bias)
    return linear


def _qkv_rows(hidden: int, tp: int, device: torch.device) -> torch.Tensor:
    """Row order of the fused q/k/v weight that gives rank ``r`` its own q, k and v heads."""
    local = hidden // tp
    order = [
        torch.arange(block * hidden + r * local, block * hidden + (r + 1) * local)
        for r in range(tp)
        for block in range(3)
    ]
    return torch.cat(order).to(device)


class DTensorTP(Contender):
    """``torch.distributed.tensor.parallel.parallelize_module`` on the same layers."""

    name, strategy = "torch-dtensor-tp", "zero3"
    description = "parallelize_module: Colwise/Rowwise on attention, MLP, vocab embedding + head"

    def setup(self, model: nn.Module, ctx: Context) -> Setup:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        hf, tp = _hf(model), dist.get_world_size()
        mesh = init_device_mesh(ctx.device.type, (tp,))
        hidden = hf.config.n_embd
        for block in hf.transformer.h:
            attn, mlp = block.attn, block.mlp
            attn.c_attn = _linear_from_conv1d(attn.c_attn, _qkv_rows(hidden, tp, ctx.device))
            attn.c_proj = _linear_from_conv1d(attn.c_proj)
            mlp.c_fc, mlp.c_proj = _linear_from_conv1d(mlp.c_fc), _linear_from_conv1d(mlp.c_proj)
            attn.split_size, attn.embed_dim = hidden // tp, hidden // tp
            attn.num_heads //= tp
            plan = {"attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel()}
            plan |= {"mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()}
            parallelize_module(block, mesh, plan)
        parallelize_module(
            hf,
            mesh,
            {
                "transformer.wte": RowwiseParallel(input_layouts=Replicate()),
                "lm_head": ColwiseParallel(output_layouts=Replicate()),
            },
        )
        hf.lm_head.weight = hf.transformer.wte.weight  # re-tie (both Shard(0) over the vocab)
        return self._optimize(hf, ctx)

    def _optimize(self, hf: Any, ctx: Context) -> Setup:
        from torch.distributed.tensor import DTensor

        params = list(hf.parameters())
        groups: list[dict[str, Any]] = [
            {"params": [p for p in params if isinstance(p, DTensor)]},
            {"params": [p for p in params if not isinstance(p, DTensor)]},
        ]  # foreach kernels do not mix DTensors and plain tensors in one group
        optimizer = torch.optim.Adam(groups, lr=ctx.lr)

        def forward_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with self._autocast(ctx):
                logits = hf(input_ids=_group_batch(x), use_cache=False).logits
                return ctx.spec.loss(logits, _group_batch(y))

        return Setup(
            forward_loss=forward_loss,
            backward=lambda loss: loss.backward(),
            step=optimizer.step,
            zero_grad=lambda: optimizer.zero_grad(set_to_none=True),
            track=[hf, optimizer],
        )


def _contenders() -> dict[str, Contender]:
    native = native_contenders()
    rows: list[Contender] = [
        DTensorTP(),
        KolossosHybrid("kolossos-tp", True, False, "torch-dtensor-tp", "HybridParallelPlugin("
                       "tp_size=world) through the Booster"),
        KolossosHybrid("kolossos-tp-sp", True, True, "torch-dtensor-tp", "the same with "
                       "enable_sequence_parallelism=True (split_gather)"),
        native["torch-ddp"],
        KolossosHybrid("kolossos-dp", False, False, "torch-ddp", "HybridParallelPlugin("
                       "tp_size=1): DDP over every rank"),
        native["single"],
    ]  # fmt: skip
    return {c.name: c for c in rows}


SUITE = Suite(
    name="tp",
    description="HybridParallelPlugin TP (+SP) vs DTensor TP vs DP vs one process, GPT-2",
    contenders=_contenders,
    references=("torch-dtensor-tp", "torch-ddp", "single"),
    quick_models=("gpt2-tiny",),
    preimport=(
        "torch.nn.parallel",
        "torch.distributed.tensor",
        "torch.distributed.tensor.parallel",
        "kolossos.booster",
        "kolossos.shardformer",
    ),
)
