"""The example's stand-in for ColossalAI-Examples' ``model_zoo`` package (its MoE models only), so
that ``from model_zoo.moe.models import Widenet`` works as the MoE page writes it."""
