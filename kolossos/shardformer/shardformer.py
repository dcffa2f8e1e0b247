"""``ShardFormer``: shard a Hugging Face model over a tensor-parallel group, in place."""

from __future__ import annotations

from torch import nn

from kolossos.shardformer.optimizations import align_plan_heads, apply_optimizations
from kolossos.shardformer.policies.auto_policy import get_autopolicy
from kolossos.shardformer.policies.base_policy import ModelPlan, Policy
from kolossos.shardformer.shard_config import ShardConfig
from kolossos.shardformer.sharder import SHARDED_ATTR, SharedParams, shard_model, tied_groups
from kolossos.shardformer.validate import validate_plan

__all__ = ["ShardFormer"]


def _resolve_plan(model: nn.Module, policy: Policy | ModelPlan | None) -> ModelPlan:
    if policy is None:
        return get_autopolicy(model).plan(model)
    if isinstance(policy, ModelPlan):
        return policy
    if isinstance(policy, Policy):
        plan = policy.plan(model)
        if not isinstance(plan, ModelPlan):
            raise TypeError(
                f"{type(policy).__name__}.plan() returned {type(plan).__name__}; it must return "
                "a kolossos.shardformer.ModelPlan."
            )
        return plan
    raise TypeError(
        f"policy={policy!r} must be None (built-in plan), a kolossos.shardformer.Policy or a "
        "ModelPlan."
    )


class ShardFormer:
    """Shards models with the tensor-parallel plans of :mod:`kolossos.shardformer.policies`.

    Args:
        shard_config: what to shard and how.

    Example:
        >>> config = ShardConfig(tensor_parallel_process_group=tp_group)  # doctest: +SKIP
        >>> model = GPT2LMHeadModel(gpt2_config)  # doctest: +SKIP
        >>> model, shared_params = ShardFormer(config).optimize(model)  # doctest: +SKIP
        >>> loss = model(input_ids, labels=input_ids).loss  # doctest: +SKIP
    """

    def __init__(self, shard_config: ShardConfig) -> None:
        if not isinstance(shard_config, ShardConfig):
            raise TypeError(f"ShardFormer needs a ShardConfig, got {type(shard_config).__name__}.")
        self.shard_config = shard_config

    def optimize(
        self, model: nn.Module, policy: Policy | ModelPlan | None = None
    ) -> tuple[nn.Module, SharedParams]:
        """Shard ``model`` in place and return it with its shared (tied) parameters.

        Every check (plan fits the model, sizes divisible by the tensor-parallel size) runs
        before the first change and the first collective. Parameter names are unchanged; each
        sharded parameter carries a ``TPShardSpec``.

        Args:
            model: a transformers model (or any model ``policy`` describes), on its final
                device and dtype, with full (unsharded) weights.
            policy: ``None`` for the built-in plan of the model's family, or your own
                :class:`Policy` / :class:`ModelPlan` for any other model.

        Returns:
            ``(model, shared_params)``: the same model object; one ``{name: parameter}`` dict
            per group of tied weights (e.g. GPT-2's ``transformer.wte.weight`` and
            ``lm_head.weight``), every name mapping to the same (sharded) parameter.

        Raises:
            ValueError: no built-in plan for the model, the plan does not fit it, a size is not
                divisible by the tensor-parallel size, or the model is already sharded.
            TypeError: ``policy`` is of the wrong type.
        """
        if hasattr(model, SHARDED_ATTR):
            raise ValueError(
                f"{type(model).__name__} is already sharded by ShardFormer; build a fresh model "
                "to shard it again."
            )
        config = self.shard_config
        if not config.enable_tensor_parallelism:
            try:
                plan = _resolve_plan(model, policy)
            except ValueError:
                if policy is None and not config.optimizations_requested:
                    return model, []  # nothing to shard and no plan needed
                raise
            apply_optimizations(model, plan, config)
            # (tensor parallelism pads its vocabulary-parallel head instead)
            align_plan_heads(model, plan, config.make_vocab_size_divisible_by)
            shared = [
                dict.fromkeys(names, model.get_parameter(names[0]))
                for names in tied_groups(model, plan)
            ]
            return model, shared
        plan = _resolve_plan(model, policy)
        validate_plan(model, plan, config.tp_size, config.sequence_parallel)
        apply_optimizations(model, plan, config)  # before sharding: the plan's paths still hold
        return model, shard_model(model, plan, config)
