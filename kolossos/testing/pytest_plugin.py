"""pytest plugin (``-p kolossos.testing.pytest_plugin``) that makes forked multi-process tests safe
and fast.

* one intra-op thread in the parent before any computation: forking a process whose thread pool
  ran leaves the children hanging;
* pre-imports the heavy ``torch.distributed`` submodules once, so forked ranks inherit them
  instead of paying 4–5 s each;
* asks NVML, not the CUDA driver, whether a GPU exists (``PYTORCH_NVML_BASED_CUDA_CHECK``): a
  driver initialised in the parent makes every CUDA call of a forked rank fail (torch's optimizers
  ask for the current stream), so the parent must not touch it before forking;
* ``gpu``-marked tests are skipped without CUDA, and run last where it is present: they create a
  CUDA context in the parent, after which ranks can no longer be forked;
* every other test runs on the CPU accelerator even where CUDA is present: the multi-process
  tests are CPU/gloo tests (several ranks would otherwise share one GPU through NCCL, which it
  refuses), and ``gpu`` tests get the CUDA accelerator back. The choice is made in the parent
  before each test, so forked ranks and spawned examples inherit it (``KOLOSSOS_ACCELERATOR``).
"""

from __future__ import annotations

import importlib
import os

import pytest

_PREIMPORT = (
    "torch.distributed",
    "torch.distributed.device_mesh",
    "torch.distributed.tensor",
    "torch.distributed.tensor.parallel",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch.distributed.pipelining",
    "torch.nn.parallel",
    "kolossos.initialize",
    "kolossos.cluster",
)


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    torch.set_num_threads(1)
    for name in _PREIMPORT:
        try:
            importlib.import_module(name)
        except ImportError:  # optional submodule missing in this torch build
            continue


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        items.sort(key=lambda item: "gpu" in item.keywords)  # stable: gpu tests last
        return
    skip = pytest.mark.skip(reason="needs CUDA (gpu marker); none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_setup(item: pytest.Item) -> None:
    from kolossos.accelerator import set_accelerator
    from kolossos.accelerator.api import ACCELERATOR_ENV

    name = "cuda" if "gpu" in item.keywords else "cpu"
    if name == "cuda":
        import torch

        if not torch.cuda.is_available():
            return  # skipped by the marker above
    os.environ[ACCELERATOR_ENV] = name
    set_accelerator(name)
