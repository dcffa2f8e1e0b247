"""Rank-aware logging: :func:`get_dist_logger`, :func:`disable_existing_loggers`."""

from kolossos.logging.logger import DistributedLogger, disable_existing_loggers, get_dist_logger

__all__ = ["DistributedLogger", "disable_existing_loggers", "get_dist_logger"]
