"""The ``kolossos`` command line: ``run``, ``check``, ``train``, ``plan`` and ``benchmark``."""
