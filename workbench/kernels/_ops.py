"""Kernel entry points: plain calls in eager mode, operators that torch.compile can see into.

Each host function (allocate outputs, launch Triton) is registered as a `torch.library` operator so
that torch.compile can put it in its graph. Two registrations:

* `torch.library.triton_op` (a GPU with compiled Triton): AOTAutograd traces the host function
  itself, its launches written as `launch(kernel)[grid](...)` become `wrap_triton` nodes, and Inductor
  launches the kernels from its generated code with its own launcher, beside the kernels it generates.
  The host function therefore has to be traceable with fake tensors: shapes and Python ints only, no
  reads of tensor data or of an autotuner's choice, no launch options Inductor does not take
  (`launch_options` drops maxnreg while tracing).
* `torch.library.custom_op` (Triton's CPU interpreter, SWINBENCH_TRITON_OP=0, or symbolic shapes): one
  opaque node per call with a fake implementation for shapes; at run time the compiled graph calls back
  into the dispatcher and the Python host function.

On the H200 (benchmarks/bench_host.py --parts compile, Swin-B batch 64) the compiled fmha stage took
49.16 ms per step with opaque ops and 36.34 ms with triton_ops, host-bound both times.

In eager mode either op's dispatcher path (schema binding, the autograd fallback, aliasing checks)
costs 15-45 µs of host time per call on top of the launch, for nothing: the op has no autograd formula
of its own (the autograd Functions wrap it). So the entry point calls the host function straight when
nothing is compiling and the op when Dynamo traces.
"""
from __future__ import annotations

import functools
import inspect
import os
import threading
from typing import Callable

import torch

_STATE = threading.local()
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def cdiv(a: int, b: int) -> int:
    """Ceiling division for the host code's grids and tile counts. Newer Triton makes `triton.cdiv` and
    `triton.next_power_of_2` constexpr functions, about 1.5 µs per host call through their wrapper;
    this is plain integer arithmetic."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), as `triton.next_power_of_2` on the host."""
    return 1 << (n - 1).bit_length()


def triton_ops_enabled() -> bool:
    """Whether operators are registered as triton_ops (Inductor launches the kernels) rather than opaque
    custom ops. Off under Triton's CPU interpreter (Inductor cannot compile the kernels for the CPU) and
    with SWINBENCH_TRITON_OP=0 (to compare the two)."""
    return (not _INTERPRET and os.environ.get("SWINBENCH_TRITON_OP", "1") != "0"
            and hasattr(torch.library, "triton_op") and torch.cuda.is_available())


def tracing() -> bool:
    """True while a triton_op's host function runs under AOTAutograd's tracing (fake tensors)."""
    return getattr(_STATE, "tracing", False)


def launch(kernel):
    """`launch(kernel)[grid](...)`: the kernel itself, or its `wrap_triton` wrapper while traced."""
    if tracing():
        return torch.library.wrap_triton(kernel)
    return kernel


def launch_options(maxnreg: int | None = None) -> dict:
    """Extra launch keywords: maxnreg, except while traced (Inductor's launcher takes only num_warps,
    num_stages and the like, so a traced kernel runs without the register cap)."""
    return {} if maxnreg is None or tracing() else {"maxnreg": maxnreg}


def _traced_body(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def body(*args, **kwargs):
        prev = tracing()
        _STATE.tracing = True
        try:
            return fn(*args, **kwargs)
        finally:
            _STATE.tracing = prev
    # fn's signature with its (string) annotations evaluated in fn's module, for the schema inference
    body.__signature__ = inspect.signature(fn, eval_str=True)
    return body


def _symbolic(args) -> bool:
    """Any symbolic size among the arguments (torch.compile with dynamic shapes)."""
    for a in args:
        if isinstance(a, torch.Tensor):
            if not all(isinstance(s, int) for s in a.shape):
                return True
        elif isinstance(a, torch.SymInt):
            return True
    return False


class KernelOp:
    """`@kernel_op("swinbench::name")` on a host function: calling it runs the function directly in
    eager mode and a registered operator while torch.compile traces: `op`, a triton_op where
    `triton_ops_enabled()`, for static shapes; `opaque`, the custom op (named name_opaque beside a
    triton_op), for symbolic ones, whose sizes the host functions' lru_cache'd launch configurations
    cannot take. `register_fake` gives the opaque op its fake implementation (a triton_op's host function
    is its own). `eager`, when given, runs instead of the op's function in eager mode: the same
    computation without an operator's constraints (an op may not return one of its inputs; a plain
    function can hand it back instead of copying)."""

    def __init__(self, name: str, fn: Callable, eager: Callable | None = None):
        self.fn = eager or fn
        self.traceable = triton_ops_enabled()
        self.opaque = torch.library.custom_op(name + ("_opaque" if self.traceable else ""), fn, mutates_args=())
        self.op = torch.library.triton_op(name, _traced_body(fn), mutates_args=()) if self.traceable else self.opaque
        self.__doc__ = fn.__doc__
        self.__name__ = getattr(fn, "__name__", name)

    def register_fake(self, fake: Callable) -> Callable:
        return self.opaque.register_fake(fake)

    def __call__(self, *args):
        if torch.compiler.is_compiling():
            if self.traceable and not _symbolic(args):
                return self.op(*args)
            return self.opaque(*args)
        return self.fn(*args)


def kernel_op(name: str, eager: Callable | None = None) -> Callable[[Callable], KernelOp]:
    return lambda fn: KernelOp(name, fn, eager)
