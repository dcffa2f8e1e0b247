"""The ``kolossos`` command line: ``run``, ``check`` (and later ``train``, ``benchmark``)."""
