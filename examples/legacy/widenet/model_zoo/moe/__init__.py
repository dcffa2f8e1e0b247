"""MoE models: ``Widenet`` (``models.py``) and the argument helpers (``util.py``)."""
