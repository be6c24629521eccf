"""A Python function that torch.compile sees as one opaque op, and that eager code calls as
the plain function.

The op is what a compiled graph needs around a body it cannot trace (host syncs such as
``.tolist()``, data-dependent shapes): one call node, shapes from the registered fake. Eager
code gains nothing from it and paid for it at every start: torch runs a custom op's Python
body through ``torch._disable_dynamo``, whose first call imports ``torch._dynamo`` (1.5-4 s on
the 2-core machines), so the first prefill of every start, even one that never compiles
(``LOCALLLM_NO_COMPILE=1``, no compiler), waited on Dynamo's import; every eager call also
went through the dispatcher. ``OpaqueOp`` calls the op only while torch.compile traces
(``torch.compiler.is_compiling()``, which Dynamo folds to True) and the function otherwise:
the same body either way, so eager and compiled give the same numbers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Generic, ParamSpec, TypeVar

import torch

P = ParamSpec("P")
R = TypeVar("R")


class OpaqueOp(Generic[P, R]):
    """``fn`` registered as the custom op ``name`` (``op``); calling this object runs the op
    under a torch.compile trace and ``fn`` itself everywhere else."""

    def __init__(self, name: str, fn: Callable[P, R], mutates_args: Iterable[str] = ()) -> None:
        self.fn = fn
        self.op = torch.library.custom_op(name, fn, mutates_args=tuple(mutates_args))
        functools.update_wrapper(self, fn)

    def register_fake(self, fake: Callable[..., object]) -> Callable[..., object]:
        """The op's shapes for tracing (``CustomOpDef.register_fake``); usable as a decorator."""
        self.op.register_fake(fake)
        return fake

    def __call__(self, *args: P.args, **kwargs: P.kwargs) -> R:
        if torch.compiler.is_compiling():
            return self.op(*args, **kwargs)  # type: ignore[no-any-return]
        return self.fn(*args, **kwargs)


def opaque_op(name: str, *, mutates_args: Iterable[str] = ()) -> Callable[[Callable[P, R]], OpaqueOp[P, R]]:
    """Decorator form of ``OpaqueOp``, in place of ``torch.library.custom_op(name, mutates_args=...)``."""

    def wrap(fn: Callable[P, R]) -> OpaqueOp[P, R]:
        return OpaqueOp(name, fn, mutates_args)

    return wrap
