"""The import path ``colossalai.testing.pytest_wrapper``: :func:`run_on_environment_flag`."""

from kolossos.testing.decorators import run_on_environment_flag

__all__ = ["run_on_environment_flag"]
