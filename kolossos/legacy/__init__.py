"""Colossal-AI's legacy, config-driven API, built on the engines below it (never the other way
round): the tensor-parallel settings read from the launch config
(:mod:`kolossos.legacy.tensor_parallel`) and the layers that follow them
(:mod:`kolossos.legacy.layers`, exported as ``kolossos.nn.Linear`` and friends).
"""
