"""Colossal-AI's legacy, config-driven API, built on the engines below it (never the other way
round): config files and the global parallel context (:mod:`kolossos.legacy.context`,
:mod:`kolossos.legacy.core`'s ``global_context``, filled by ``kolossos.launch`` through
:mod:`kolossos.legacy.launch_hook`), the registries and constants, the tensor-parallel settings
read from the launch config (:mod:`kolossos.legacy.tensor_parallel`) and the layers that follow
them (:mod:`kolossos.legacy.nn.layer.colossalai_layer`, exported as ``kolossos.nn.Linear``
and friends), and
``initialize`` → :class:`~kolossos.legacy.engine.Engine` with the AMP modes of
:mod:`kolossos.legacy.amp` (:mod:`kolossos.legacy.initialize`, also ``kolossos.initialize``).
See ``docs/legacy.md``.
"""
