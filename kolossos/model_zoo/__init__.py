"""Colossal-AI's tutorial import paths ``model_zoo.vit.vit`` and ``model_zoo.gpt.gpt``
(``import model_zoo...`` becomes ``import kolossos.model_zoo...``): thin aliases of
:mod:`kolossos.legacy.models.vit`, :mod:`~kolossos.legacy.models.vit_pipeline`,
:mod:`~kolossos.legacy.models.gpt` and :mod:`~kolossos.legacy.models.gpt_pipeline`. Importing
this package loads none of them.

Example:
    >>> from kolossos.model_zoo.vit.vit import ViTBlock  # doctest: +SKIP
"""
