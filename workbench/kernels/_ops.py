"""Kernel entry points that are custom ops under torch.compile and plain calls in eager mode.

Each host function (allocate outputs, launch Triton) is registered as a `torch.library` custom op
so that torch.compile records it as one opaque node with a fake implementation for shapes. In
eager mode the op's dispatcher path (schema binding, the autograd fallback, aliasing checks) costs
15-45 µs of host time per call on the H200 machine (benchmarks/bench_host.py) on top of the launch,
for nothing: the op has no autograd formula of its own (the autograd Functions wrap it). So the
entry point calls the function straight when nothing is compiling and the op when Dynamo traces.
"""
from __future__ import annotations

from typing import Callable

import torch


class OpaqueOp:
    """`@opaque_op("swinbench::name")` on a host function: calling it runs the function directly in
    eager mode and the registered custom op while torch.compile traces. `register_fake` and `op`
    reach the custom op (for fake implementations and torch.library.opcheck). `eager`, when given, runs
    instead of the op's function in eager mode: the same computation without a custom op's constraints
    (an op may not return one of its inputs; a plain function can hand it back instead of copying)."""

    def __init__(self, name: str, fn: Callable, eager: Callable | None = None):
        self.fn = eager or fn
        self.op = torch.library.custom_op(name, fn, mutates_args=())
        self.__doc__ = fn.__doc__
        self.__name__ = getattr(fn, "__name__", name)

    def register_fake(self, fake: Callable) -> Callable:
        return self.op.register_fake(fake)

    def __call__(self, *args):
        if torch.compiler.is_compiling():
            return self.op(*args)
        return self.fn(*args)


def opaque_op(name: str, eager: Callable | None = None) -> Callable[[Callable], OpaqueOp]:
    return lambda fn: OpaqueOp(name, fn, eager)
