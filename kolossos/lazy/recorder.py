"""The dispatch mode that builds tensors on the meta device and writes what it did to a tape.

Inside :class:`Recorder` every aten operator falls in one of three kinds:

* a factory (no tensor argument, a ``device`` keyword: ``empty``, ``zeros``, ``randn``, ...): run
  on the meta device, its output becomes a new lazy storage, the call is recorded with the device
  it would have used;
* an operator touching a lazy tensor: run on meta tensors, recorded when it creates a storage or
  writes one (views and shape queries are not recorded: they change nothing);
* anything else (ordinary tensors only, e.g. ``torch.tensor(...)`` data): runs as usual.

Operators that need a lazy tensor's values (``.item()``, ``nonzero``, printing) cannot run, and
say so.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from kolossos.lazy.init_functions import recorded_init_functions
from kolossos.lazy.tape import LAZY_ATTR, LazyStorage, Tape, TapeOp, lazy_storage, ref_of

__all__ = ["Recorder", "default_generator"]

_META = torch.device("meta")
#: in-place operators whose result does not depend on the old contents of ``self``
_OVERWRITING = frozenset(
    {
        "uniform_",
        "normal_",
        "random_",
        "bernoulli_",
        "exponential_",
        "geometric_",
        "cauchy_",
        "log_normal_",
        "fill_",
        "zero_",
        "copy_",
    }
)
#: random operators, also those without a ``generator`` argument (``randn.default``, dropout)
_RANDOM = frozenset(
    {
        "rand",
        "randn",
        "randint",
        "randperm",
        "rand_like",
        "randn_like",
        "randint_like",
        "normal",
        "bernoulli",
        "multinomial",
        "poisson",
        "native_dropout",
        "uniform",
        "exponential",
        "geometric",
        "cauchy",
        "log_normal",
        "random",
        "rrelu_with_noise",
    }
)
#: operators that would give a lazy storage a different size or another storage
_REFUSED = frozenset({"set_", "resize_", "resize_as_"})


def default_generator(device: torch.device) -> torch.Generator:
    """The default random generator of ``device`` (``cpu`` or ``cuda``).

    Raises:
        NotImplementedError: another device type.
    """
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    raise NotImplementedError(
        f"lazy initialisation draws random numbers on cpu or cuda only, not {device}; build the "
        "model on one of them."
    )


def _schema_args(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """``(schema argument, value)`` pairs of a call."""
    pairs = []
    for i, arg in enumerate(func._schema.arguments):
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        pairs.append((arg, value))
    return pairs


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


class Recorder(TorchDispatchMode):
    """Record the construction of lazy tensors on ``tape``.

    Args:
        tape: where the ops go.
        default_device: the real device of factory calls that name none (``None``: torch's
            default device).
    """

    def __init__(self, tape: Tape, default_device: torch.device | None) -> None:
        super().__init__()
        self.tape = tape
        self.default_device = default_device
        self.active = False
        self._patches: ExitStack | None = None

    def __enter__(self) -> Recorder:
        self._patches = ExitStack()
        self._patches.enter_context(recorded_init_functions(self))
        super().__enter__()
        self.active = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self.active = False
        super().__exit__(*exc)
        assert self._patches is not None
        self._patches.close()

    def record_call(
        self,
        fn: Any,
        tensor: torch.Tensor,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        random: bool,
    ) -> None:
        """Record ``fn(tensor, *args, **kwargs)``, a function writing all of ``tensor``."""
        record = lazy_storage(tensor)
        assert record is not None
        ref = ref_of(tensor, record.key)
        whole = ref.covers(self.tape.nbytes[record.key])
        op = TapeOp(
            func=fn,
            args=(ref, *(_to_refs(a) for a in args)),
            kwargs={k: _to_refs(v) for k, v in kwargs.items() if k != "generator"},
            creates=[],
            reads=frozenset() if whole else frozenset({record.key}),
            writes=frozenset({record.key}),
            overwrites=frozenset({record.key}) if whole else frozenset(),
        )
        if random:
            explicit = kwargs.get("generator")
            gen = explicit or default_generator(self.tape.devices[record.key])
            op.generator, op.reseed = self.tape.note_generator(gen)
            op.explicit_generator = explicit is not None
        self.tape.ops.append(op)

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        flat, _ = tree_flatten((args, kwargs))
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        lazy = [x for x in tensors if lazy_storage(x) is not None]
        names = {a.name for a in func._schema.arguments}
        if not tensors and "device" in names:
            return self._record(func, args, kwargs, factory=True)
        if lazy:
            return self._record(func, args, kwargs, factory=False)
        return func(*args, **kwargs)

    # ------------------------------------------------------------------ recording
    def _real_device(
        self, kwargs: dict[str, Any], lazy: list[torch.Tensor], constants: list[torch.Tensor]
    ) -> torch.device:
        device = kwargs.get("device")
        if device is not None:
            return torch.device(device)
        if lazy:
            record = lazy_storage(lazy[0])
            assert record is not None
            return self.tape.devices[record.key]
        if constants:
            return constants[0].device
        if self.default_device is not None:
            return self.default_device
        return torch.get_default_device()

    def _record(
        self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, factory: bool
    ) -> Any:
        name = func._schema.name.split("::")[-1]
        if name in _REFUSED:
            raise NotImplementedError(
                f"LazyInitContext: aten.{name} on a lazily initialised tensor is not supported "
                "(it would replace the storage); do it after LazyInitContext.materialize()."
            )
        pairs = _schema_args(func, args, kwargs)
        lazy_inputs = [t for a, v in pairs for t in _tensors(v) if lazy_storage(t) is not None]
        constants = [t for a, v in pairs for t in _tensors(v) if lazy_storage(t) is None]
        device = self._real_device(kwargs, lazy_inputs, constants)
        reads: set[int] = set()
        writes: set[int] = set()
        overwrites: set[int] = set()
        for index, (arg, value) in enumerate(pairs):
            written = arg.alias_info is not None and arg.alias_info.is_write
            for tensor in _tensors(value):
                record = lazy_storage(tensor)
                if record is None:
                    if written:
                        raise RuntimeError(
                            f"LazyInitContext: aten.{name} writes an ordinary tensor from a "
                            "lazily initialised one, whose values do not exist yet; "
                            "materialise the model first (LazyInitContext.materialize)."
                        )
                    continue
                if record.tape is not self.tape:
                    raise RuntimeError(
                        "LazyInitContext: an operator mixes tensors of two lazy contexts; build "
                        "the model in one context, or materialise the other first."
                    )
                ref = ref_of(tensor, record.key)
                if not written:
                    reads.add(record.key)
                    continue
                writes.add(record.key)
                if index == 0 and name in _OVERWRITING and ref.covers(self.tape.nbytes[ref.key]):
                    overwrites.add(record.key)
                else:
                    reads.add(record.key)
        out = self._run_on_meta(func, name, args, kwargs)
        op = TapeOp(
            func=func,
            args=tuple(_to_refs(a) for a in args),
            kwargs={k: _to_refs(v) for k, v in kwargs.items()},
            creates=[],
            reads=frozenset(reads),
            writes=frozenset(writes),
            overwrites=frozenset(overwrites - reads),
        )
        has_device = any(a.name == "device" for a, _ in pairs)
        if has_device and (factory or kwargs.get("device") is not None):
            op.kwargs["device"] = device
        if name.rstrip("_") in _RANDOM or any("Generator" in str(a.type) for a, _ in pairs):
            explicit = kwargs.get("generator")
            gen = explicit or default_generator(device)
            op.generator, op.reseed = self.tape.note_generator(gen)
            op.explicit_generator = explicit is not None
            op.kwargs.pop("generator", None)
        self._note_outputs(op, out, device)
        if op.creates or op.writes or op.generator is not None:
            self.tape.ops.append(op)
        return out

    def _run_on_meta(
        self, func: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        meta_args, meta_kwargs = _to_meta((args, dict(kwargs)))
        if "device" in meta_kwargs:
            meta_kwargs["device"] = _META
        meta_kwargs.pop("generator", None)
        try:
            return func(*meta_args, **meta_kwargs)
        except (NotImplementedError, RuntimeError) as exc:
            raise RuntimeError(
                f"LazyInitContext: aten.{name} cannot run on a lazily initialised tensor ({exc}). "
                "It needs values that do not exist until materialisation: build this part "
                "outside the context, or call LazyInitContext.materialize(module) first."
            ) from exc

    def _note_outputs(self, op: TapeOp, out: Any, device: torch.device) -> None:
        flat, _ = tree_flatten(out)
        for position, tensor in enumerate(flat):
            if not isinstance(tensor, torch.Tensor) or lazy_storage(tensor) is not None:
                continue  # an alias of an input, or not a tensor
            storage = tensor.untyped_storage()
            key = self.tape.new_key(storage.nbytes(), device)
            setattr(storage, LAZY_ATTR, LazyStorage(self.tape, key))
            op.creates.append((position, ref_of(tensor, key)))


def _to_refs(value: Any) -> Any:
    """``value`` with lazy tensors as :class:`TensorRef` and ordinary tensors copied."""
    flat, spec = tree_flatten(value)
    out: list[Any] = []
    for x in flat:
        record = lazy_storage(x) if isinstance(x, torch.Tensor) else None
        if record is not None:
            out.append(ref_of(x, record.key))
        elif isinstance(x, torch.Tensor):
            out.append(x.detach().clone())  # a constant: later changes must not leak in
        else:
            out.append(x)
    return tree_unflatten(out, spec)


def _to_meta(value: Any) -> Any:
    """``value`` with ordinary tensors replaced by meta tensors of the same geometry."""
    flat, spec = tree_flatten(value)
    out = [x if not isinstance(x, torch.Tensor) or x.is_meta else x.to(_META) for x in flat]
    return tree_unflatten(out, spec)
