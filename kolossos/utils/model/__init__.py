"""Model-construction helpers the documents import from ``colossalai.utils.model``."""

from kolossos.utils.model.colo_init_context import ColoInitContext, post_process_colo_init_ctx

__all__ = ["ColoInitContext", "post_process_colo_init_ctx"]
