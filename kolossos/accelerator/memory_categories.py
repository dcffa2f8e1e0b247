"""The categories :class:`~kolossos.accelerator.TensorMemoryTracker` bills tensor memory to."""

__all__ = ["ACTIVATIONS", "BUFFERS", "GRADS", "OPTIM", "OTHER", "PARAMS"]

PARAMS = "params"  #: category of module parameters (and optimizer master weights)
BUFFERS = "buffers"  #: category of module buffers
GRADS = "grads"  #: category of ``.grad`` tensors
OPTIM = "optim"  #: category of optimizer states (and of temporaries inside ``optimizer.step``)
ACTIVATIONS = "activations"  #: category for forward activations (set it with ``category()``)
OTHER = "other"  #: category of everything not labelled otherwise
