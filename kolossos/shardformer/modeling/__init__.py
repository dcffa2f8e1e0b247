"""Replacement forwards the plans install for ShardFormer's optimisations
(``enable_jit_fused``)."""
