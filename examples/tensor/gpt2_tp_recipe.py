"""The Megatron-style sharding recipe of the documents' GPT-2 examples, on an unmodified Hugging
Face ``GPT2LMHeadModel`` whose parameters are ColoParameters (built under ``ColoInitContext``).

``mlp.c_fc`` weight and bias: column split, output kept sharded; ``mlp.c_proj`` weight: row
split (its bias replicated); ``wte`` / ``wpe`` and the attention ``c_attn`` / ``c_proj``: column
split; everything else replicated. ``visited`` marks tied weights so each is cut once.
The code is the documents' (``colossalai`` -> ``kolossos``).
"""

import torch

from kolossos.tensor import (
    ColoParameter,
    ComputePattern,
    ComputeSpec,
    ProcessGroup,
    ReplicaSpec,
    ShardSpec,
)


def split_param_single_dim_tp1d(dim: int, param: ColoParameter, pg: ProcessGroup):
    spec = (ShardSpec([dim], [pg.tp_world_size()]), ComputeSpec(ComputePattern.TP1D))
    param.set_tensor_spec(*spec)


def split_param_row_tp1d(param: ColoParameter, pg: ProcessGroup):
    split_param_single_dim_tp1d(0, param, pg)


def split_param_col_tp1d(param: ColoParameter, pg: ProcessGroup):
    split_param_single_dim_tp1d(-1, param, pg)


def tensor_parallelize(model: torch.nn.Module, pg: ProcessGroup):
    """Shard the model's parameters with the Megatron pattern over ``pg``'s tp group."""
    for mn, module in model.named_modules():
        for pn, param in module.named_parameters(recurse=False):
            # a param may be shared by two modules
            if hasattr(param, "visited"):
                continue
            # if shard init, then convert param to replica and use the dp-only ProcessGroup
            param: ColoParameter = param
            param.set_dist_spec(ReplicaSpec())
            param.set_process_group(pg)
            # shard it w.r.t tp pattern
            if "mlp.c_fc" in mn:
                if "weight" in pn or "bias" in pn:
                    split_param_col_tp1d(param, pg)  # column slice
                    # keep the shape of the output from c_fc
                    param.compute_spec.set_output_replicate(False)
                else:
                    param.set_dist_spec(ReplicaSpec())
            elif "mlp.c_proj" in mn:
                if "weight" in pn:
                    split_param_row_tp1d(param, pg)  # row slice
                else:
                    param.set_dist_spec(ReplicaSpec())
            elif "wte" in mn or "wpe" in mn:  # noqa: SIM114 (the documents' code)
                split_param_col_tp1d(param, pg)  # column slice
            elif "c_attn" in mn or "c_proj" in mn:
                split_param_col_tp1d(param, pg)  # column slice
            else:
                param.set_dist_spec(ReplicaSpec())
            param.visited = True
