"""``kolossos benchmark``: Colossal-AI's tensor-parallel micro-benchmark (``colossalai benchmark
--gpus N``) on N local processes.

Every tensor-parallel layout N ranks allow (data parallel, 1D, 2D, 2.5D at each depth, 3D) runs
Colossal-AI's MLP on an input of shape ``(batch_size, seq_len, dimension)``; the command prints
the time per step, the peak memory and the bytes communicated per step of each as a table (and
JSON with ``--json``). Modules: :mod:`.layouts` (which layouts, which sizes fit; pure),
:mod:`.options`, :mod:`.command` (the command line), :mod:`.worker` and :mod:`.measure` (the
processes), :mod:`.model` (the MLP and its input blocks), :mod:`.report` (table and JSON).

Example::

    kolossos benchmark --nproc 4
    kolossos benchmark --gpus 8 --batch_size 16 --dimension 2048 --json bench.json
"""

from __future__ import annotations

from kolossos.cli.benchmark.command import main

__all__ = ["main"]
