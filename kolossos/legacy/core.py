"""``from kolossos.legacy.core import global_context as gpc``: the global parallel context
(Colossal-AI's ``colossalai.core``). Importing it installs the launch hook that fills it."""

from kolossos.legacy.context.parallel_context import global_context
from kolossos.legacy.launch_hook import GLOBAL_CONTEXT_HOOK

__all__ = ["GLOBAL_CONTEXT_HOOK", "global_context"]
