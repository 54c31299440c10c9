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
#     call time, is replaced, once, by a proxy for the calling thread's rank generator (the real
#     one on any other thread);
# (2) a torch function mode, pushed on each rank thread, passes the rank's generator to every
#     torch function and Tensor method that takes ``generator=`` and was given none (or the real
#     default one), and runs the few functions that draw inside without taking one (dropout,
#     RNN dropout, rrelu, scaled dot-product attention, nn.init, ...) under a dispatch mode that
#     does the same to the aten ops they reach. Both modes pass everything else through; the
#     function mode costs a few percent of a small model's step, the dispatch mode is never on
#     outside those calls.
# (3) torch runs an intercepted function's body with the mode popped, and backward's body is
#     the autograd engine, which runs Python (hooks, checkpoint's recomputed forward): so
#     Tensor.backward and torch.autograd.backward are run by the mode itself, with the mode
#     pushed again around the engine (see _backward_under).
# What the modes cannot see (a thread the rank starts, a C++ extension drawing from the default
# generator) still draws from the shared generator; ``RankStreams.check_global_untouched``
# detects that after the run (the default generator moved while only ranks ran) and warns.
"""

from __future__ import annotations

import inspect
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__: list[str] = []

# The process's default CPU generator, whatever torch.random.default_generator is replaced by.
_REAL: torch.Generator = torch.default_generator

# _state.generator: the rank generator of the calling thread (None outside rank threads).
_state = threading.local()
# Guards the one-time replacement of torch.random.default_generator.
_install_lock = threading.Lock()


def _current() -> torch.Generator:
    generator: torch.Generator | None = getattr(_state, "generator", None)
    return _REAL if generator is None else generator


class _DefaultGeneratorProxy:
    """Stands in for ``torch.random.default_generator``: the calling rank's generator. See
    Note [Per-rank generators]."""

    def __getattr__(self, name: str) -> Any:
        return getattr(_current(), name)

    def __repr__(self) -> str:
        return f"<fakepg per-rank default generator: {_current()!r}>"


def _install_proxy() -> None:
    """Replace ``torch.random.default_generator`` by the proxy, once.

    A private torch name, unavoidably: torch has no per-thread default generator, and the
    functions of ``torch.random`` read this module global at call time.
    """
    with _install_lock:
        namespace = vars(torch.random)
        if not isinstance(namespace["default_generator"], _DefaultGeneratorProxy):
            namespace["default_generator"] = _DefaultGeneratorProxy()


def _functions_taking_a_generator() -> frozenset[Callable[..., Any]]:
    """The torch functions and Tensor methods whose aten schemas take ``generator=``."""
    names = set()
    for schema in torch._C._jit_get_all_schemas():
        if schema.name.startswith("aten::") and any(
            a.name == "generator" for a in schema.arguments
        ):
            names.add(schema.name.removeprefix("aten::"))
    names -= {"seed", "manual_seed", "initial_seed"}
    found: set[Callable[..., Any]] = set()
    for name in names:
        for owner in (torch, torch.Tensor):
            fn = getattr(owner, name, None)
            if callable(fn):
                found.add(fn)
    return frozenset(found)


def _functions_drawing_inside() -> frozenset[Callable[..., Any]]:
    """Functions that draw from the default generator without taking one."""
    torch_names = [
        "dropout", "dropout_", "feature_dropout", "feature_dropout_", "alpha_dropout",
        "alpha_dropout_", "feature_alpha_dropout", "feature_alpha_dropout_", "native_dropout",
        "lstm", "gru", "rnn_tanh", "rnn_relu", "_transformer_encoder_layer_fwd",
        "_native_multi_head_attention", "scaled_dot_product_attention",
    ]  # fmt: skip
    functional_names = [
        "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
        "feature_alpha_dropout", "rrelu", "rrelu_", "gumbel_softmax", "fractional_max_pool2d",
        "fractional_max_pool3d", "fractional_max_pool2d_with_indices",
        "fractional_max_pool3d_with_indices", "multi_head_attention_forward",
        "scaled_dot_product_attention",
    ]  # fmt: skip
    found: set[Callable[..., Any]] = set()
    for owner, names in ((torch, torch_names), (F, functional_names)):
        for name in names:
            fn = getattr(owner, name, None)
            if callable(fn):
                found.add(fn)
    for name in dir(torch.nn.init):
        fn = getattr(torch.nn.init, name)
        if callable(fn) and getattr(fn, "__module__", "") == "torch.nn.init":
            found.add(fn)
    return frozenset(found)


_TAKES_GENERATOR = _functions_taking_a_generator()
_DRAWS_INSIDE = _functions_drawing_inside()
_BACKWARD = frozenset({torch.Tensor.backward, torch.autograd.backward})


def _backward_under(
    mode: TorchFunctionMode,
    func: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    """``func`` (Tensor.backward or torch.autograd.backward) with ``mode`` on the stack while
    the engine runs. See Note [Per-rank generators], (3).

    torch.autograd.backward's own steps, through torch's private autograd helpers: torch
    dispatches every call of the public functions to the modes on the stack first, so their
    body can never run with the mode pushed.
    """
    bound = inspect.signature(func).bind(*args, **kwargs)
    bound.apply_defaults()
    given = bound.arguments
    if func is torch.Tensor.backward:
        tensors: Any = given["self"]
        grad_tensors = given["gradient"]
    else:
        tensors = given["tensors"]
        grad_tensors = given["grad_tensors"]
        if grad_tensors is None:
            grad_tensors = given.get("grad_variables")
    inputs = given["inputs"]
    retain_graph, create_graph = given["retain_graph"], given["create_graph"]
    if isinstance(inputs, dict):
        inputs = tuple(inputs.values())
    elif isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    inputs_tuple = () if inputs is None else tuple(inputs)
    if inputs is not None and not inputs_tuple:
        raise RuntimeError("`inputs` argument to `backward()` cannot be empty.")
    if isinstance(tensors, torch.Tensor | torch.autograd.graph.GradientEdge):
        tensors = (tensors,)
    tensors = tuple(tensors)
    autograd: Any = torch.autograd
    grads = autograd._tensor_or_tensors_to_tuple(grad_tensors, len(tensors))
    grads = autograd._make_grads(tensors, grads, is_grads_batched=False)
    if retain_graph is None:
        retain_graph = create_graph
    with mode:
        autograd.graph._engine_run_backward(
            tensors,
            grads,
            retain_graph,
            create_graph,
            inputs_tuple,
            allow_unreachable=True,
            accumulate_grad=True,
        )


class _RankRandomness(TorchFunctionMode):
    """Routes a rank's draws to its generator. See Note [Per-rank generators]."""

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.generator = generator

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: object,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in _BACKWARD:
            return _backward_under(self, func, args, kwargs)
        if func in _TAKES_GENERATOR:
            given = kwargs.get("generator")
            if given is None or given is _REAL:
                kwargs = {**kwargs, "generator": self.generator}
        elif func in _DRAWS_INSIDE:
            with _InjectGenerator(self.generator):
                return func(*args, **kwargs)
        return func(*args, **kwargs)


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
        _install_proxy()
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
    generator = streams.generators[rank]
    previous = getattr(_state, "generator", None)
    _state.generator = generator
    try:
        with _RankRandomness(generator):
            yield
    finally:
        _state.generator = previous
