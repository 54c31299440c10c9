"""Per-rank random numbers: each rank thread of a run draws from a torch.Generator of its own.

Ranks are threads of one process, and torch has one default CPU generator per process: without
this, ``torch.manual_seed(seed + rank)`` on one rank reseeds every rank, and dropout masks, data
shuffles and ``checkpoint(preserve_rng_state=True)`` replays interleave across ranks by thread
timing. See Note [Per-rank generators].

# Guarantees: a rank's generator is used only from that rank's thread (torch's function and
# dispatch modes are thread-local, and so is the generator the proxy resolves). Installing the
# proxy is idempotent and safe from any thread; outside rank threads it changes nothing.

# Note [Per-rank generators]
# Each rank thread gets a generator that starts as a copy of the launching thread's default
# generator (as a forked process inherits its parent's), so a rank that never seeds draws what a
# fresh process would, and a rank that seeds gets exactly the stream a process seeded alike gets.
# Swapping the default generator's state in and out around a rank's turn is not sound: ranks run
# truly in parallel whenever torch releases the GIL, so two ranks' draws could meet in the one
# generator. Instead nothing a rank draws goes through the default generator:
# (1) ``torch.random.default_generator``, which torch.manual_seed, torch.seed, initial_seed,
#     get_rng_state, set_rng_state and fork_rng (hence checkpoint's preserve_rng_state) read at
#     call time, is replaced by a proxy for the calling thread's rank generator (the real one on
#     any other thread);
# (2) the torch functions and Tensor methods that take ``generator=`` (found from the aten
#     schemas: rand, randn, randint, randperm, normal, bernoulli, multinomial, Tensor.uniform_,
#     normal_, random_, ...) are wrapped: on a rank thread, a call given no generator (or the
#     real default one) gets the rank's; nn.init, samplers and user code reach them;
# (3) the few that draw inside C++ without taking one (dropout and its variants, RNN dropout,
#     scaled dot-product attention, the fused transformer and attention kernels) are wrapped
#     to run, on a rank thread, under a dispatch mode that does (2) to the aten ops they reach;
#     except plain dropout of a CPU tensor, the common case, which the wrapper computes as
#     torch's C++ does, with the rank's generator, sparing each of its ops a pass through
#     Python (see _dropout).
# The wrappers are installed once, process-wide and for good (like the per-thread group state of
# fakepg.torch_backend), and cost a thread-local lookup per call outside rank threads. They are
# found through the module and class attributes callers look up (torch's own modules that
# imported one by name are rebound), so a call through a reference another module took before
# installation (``from torch import randn`` at its import) is not covered, nor is a thread a
# rank starts, nor a C++ extension drawing from the default generator: those still
# draw from the shared generator, and ``RankStreams.check_global_untouched`` detects it after
# the run (the default generator moved while only ranks ran) and warns.
"""

from __future__ import annotations

import functools
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from . import _homes

__all__: list[str] = []

# The process's default CPU generator, whatever torch.random.default_generator is replaced by.
_REAL: torch.Generator = torch.default_generator

# _state.generator: the rank generator of the calling thread (None outside rank threads).
_state = threading.local()
# Guards the one-time installation of the proxy and the wrappers.
_install_lock = threading.Lock()
_installed = False


def _rank_generator() -> torch.Generator | None:
    generator: torch.Generator | None = getattr(_state, "generator", None)
    return generator


def _current() -> torch.Generator:
    generator = _rank_generator()
    return _REAL if generator is None else generator


class _DefaultGeneratorProxy:
    """Stands in for ``torch.random.default_generator``: the calling rank's generator. See
    Note [Per-rank generators]."""

    def __getattr__(self, name: str) -> Any:
        return getattr(_current(), name)

    def __repr__(self) -> str:
        return f"<fakepg per-rank default generator: {_current()!r}>"


def _generator_positions() -> dict[str, int | None]:
    """Per aten op name that takes ``generator=``: its position where it may be passed
    positionally (counting self or input), else None."""
    found: dict[str, int | None] = {}
    for schema in torch._C._jit_get_all_schemas():
        if not schema.name.startswith("aten::"):
            continue
        for i, argument in enumerate(schema.arguments):
            if argument.name == "generator":
                name = schema.name.removeprefix("aten::")
                position = None if argument.kwarg_only else i
                found[name] = found.get(name) if position is None else position
    for name in ("seed", "manual_seed", "initial_seed"):
        found.pop(name, None)
    return found


def _with_rank_generator(fn: Callable[..., Any], position: int | None) -> Callable[..., Any]:
    """``fn``, given the rank's generator on a rank thread when the caller passed none."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        generator = _rank_generator()
        if generator is not None:
            if position is not None and len(args) > position:
                if args[position] is None or args[position] is _REAL:
                    args = (*args[:position], generator, *args[position + 1 :])
            elif kwargs.get("generator") is None or kwargs.get("generator") is _REAL:
                kwargs["generator"] = generator
        return fn(*args, **kwargs)

    wrapper.__fakepg_wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def _drawing_inside(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, run on a rank thread under a dispatch mode that gives its aten ops the rank's
    generator."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        generator = _rank_generator()
        if generator is None:
            return fn(*args, **kwargs)
        with _InjectGenerator(generator):
            return fn(*args, **kwargs)

    wrapper.__fakepg_wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def _dropout(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.dropout`` (what ``F.dropout`` and ``nn.Dropout`` call): on a rank thread, for a
    plain CPU tensor, the steps torch's C++ takes there (``at::native::_dropout_impl``, as the
    fused kernel is for GPUs only: a mask drawn ``bernoulli_(1 - p)``, divided by ``1 - p``,
    times the input), drawn from the rank's generator. The same bits and autograd graph as
    ``_drawing_inside``, without a dispatch mode whose every op passes through Python (a
    training step's dropouts cost a rank thread a tenth of its CPU time that way)."""
    inside = _drawing_inside(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        generator = _rank_generator()
        if generator is not None and len(args) == 3 and not kwargs:
            x, p, train = args
            if (
                train is True
                and type(p) is float
                and 0.0 < p < 1.0
                and type(x) in _PLAIN
                and x.device.type == "cpu"
                and x.numel() > 0
            ):
                noise = torch.empty_like(x)
                noise.bernoulli_(1 - p, generator=generator)
                noise.div_(1 - p)
                return x * noise
        return inside(*args, **kwargs)

    wrapper.__fakepg_wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


_PLAIN = (torch.Tensor, torch.nn.Parameter)

# Functions that draw from the default generator inside C++ without taking a generator, by the
# namespaces callers find them in (torch._VF is where nn.functional and nn.RNN look).
_DRAWS_INSIDE = (
    "dropout", "dropout_", "feature_dropout", "feature_dropout_", "alpha_dropout",
    "alpha_dropout_", "feature_alpha_dropout", "feature_alpha_dropout_", "native_dropout",
    "lstm", "gru", "rnn_tanh", "rnn_relu", "_transformer_encoder_layer_fwd",
    "_native_multi_head_attention",
)  # fmt: skip


def _install() -> None:
    """Install the proxy and the wrappers, once. See Note [Per-rank generators].

    Private torch names, unavoidably: torch has no per-thread default generator; the functions
    of ``torch.random`` read their module global ``default_generator`` at call time, and
    ``torch._VF`` is where torch's own modules find the C++ functions they call.
    """
    global _installed
    with _install_lock:
        if _installed:
            return
        vars(torch.random)["default_generator"] = _DefaultGeneratorProxy()
        wraps: list[tuple[Any, str, Callable[..., Any]]] = []
        for name, position in _generator_positions().items():
            for owner in (torch, torch.Tensor):
                fn = getattr(owner, name, None)
                if callable(fn):
                    wraps.append((owner, name, _with_rank_generator(fn, position)))
        for owner in (torch, torch._VF):
            for name in _DRAWS_INSIDE:
                fn = getattr(owner, name, None)
                if callable(fn):
                    wrap = _dropout if name == "dropout" else _drawing_inside
                    wraps.append((owner, name, wrap(fn)))
        wraps.append(
            (F, "scaled_dot_product_attention", _drawing_inside(F.scaled_dot_product_attention))
        )
        for owner, name, wrapper in wraps:
            if owner is not torch.Tensor:
                # TorchScript resolves a Python function through a table of builtins (a
                # method by its name): the wrapper must resolve to the aten op it wraps.
                torch.jit._builtins._register_builtin(wrapper, f"aten::{name}")
            setattr(owner, name, wrapper)
        _rebind_torch_imports({id(w.__fakepg_wrapped__): w for _, _, w in wraps})  # type: ignore[attr-defined]
        _installed = True


def _rebind_torch_imports(wrappers: dict[int, Callable[..., Any]]) -> None:
    """torch's own modules that imported a wrapped function by name (``from torch import
    randperm`` in torch.utils.data.dataset, for random_split) get the wrapper too."""
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("torch.") or module is None:
            continue
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            wrapper = wrappers.get(id(value))
            if wrapper is not None and wrapper.__fakepg_wrapped__ is value:  # type: ignore[attr-defined]
                namespace[name] = wrapper


class _InjectGenerator(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Passes ``generator`` to every aten op that takes one and was given none."""

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.generator = generator

    def __torch_dispatch__(
        self,
        func: Any,
        types: object,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        where = _generator_argument(func)
        if where is not None:
            index, keyword_only = where
            if keyword_only or index >= len(args):
                if kwargs.get("generator") in (None, _REAL):
                    kwargs = {**kwargs, "generator": self.generator}
            elif args[index] is None or args[index] is _REAL:
                args = (*args[:index], self.generator, *args[index + 1 :])
        return func(*args, **kwargs)


_GENERATOR_ARGUMENT: dict[Any, tuple[int, bool] | None] = {}


def _generator_argument(op: Any) -> tuple[int, bool] | None:
    """(position, keyword-only) of ``op``'s generator argument, or None; cached per op."""
    try:
        return _GENERATOR_ARGUMENT[op]
    except KeyError:
        pass
    found = None
    for i, argument in enumerate(op._schema.arguments):
        if argument.name == "generator":
            found = (i, argument.kwarg_only)
    _GENERATOR_ARGUMENT[op] = found
    return found


class RankStreams:
    """The generators of one run's ranks, each a copy of the launching thread's generator."""

    def __init__(self, world_size: int) -> None:
        _install()
        state = _current().get_state()
        self.generators = []
        for _ in range(world_size):
            generator = torch.Generator()
            generator.set_state(state)
            self.generators.append(generator)
        self._global_before = _REAL.get_state()

    def check_global_untouched(self) -> None:
        """Warn if the process's default generator moved while the ranks ran: something drew
        from it outside what the per-rank generators cover (see Note [Per-rank generators])."""
        if not torch.equal(_REAL.get_state(), self._global_before):
            warnings.warn(
                "fakepg: torch's default generator was used while the ranks ran, so some random "
                "numbers came from the one generator every rank shares (their values depend on "
                "thread timing). Per-rank generators cover torch functions called on rank "
                "threads; a thread started by a rank, or a C++ extension that draws from the "
                "default generator, is not covered: pass it a generator of its own "
                "(torch.Generator().manual_seed(...)).",
                RuntimeWarning,
                stacklevel=3,
            )


@contextmanager
def rank_stream(streams: RankStreams | None, rank: int) -> Iterator[None]:
    """On this (rank) thread, draw from ``streams.generators[rank]``; nothing if None."""
    if streams is None:
        yield
        return
    previous = _rank_generator()
    _state.generator = streams.generators[rank]
    try:
        yield
    finally:
        _state.generator = previous


def _lend_generator() -> Callable[[], AbstractContextManager[None]] | None:
    """On a rank's thread: lends its generator to the threads that run its callbacks (see
    Note [Callbacks run in their rank] in fakepg._homes)."""
    generator = _rank_generator()
    if generator is None:
        return None

    @contextmanager
    def lend() -> Iterator[None]:
        previous = _rank_generator()
        _state.generator = generator
        try:
            yield
        finally:
            _state.generator = previous

    return lend


_homes.register(_lend_generator)
