"""Kernel entry points: plain calls in eager mode, operators that torch.compile can see into.

Each host function (allocate outputs, launch Triton) is registered as a `torch.library` operator so
that torch.compile can put it in its graph. Two registrations:

* `torch.library.triton_op` (a GPU with compiled Triton): AOTAutograd traces the host function
  itself, its launches written as `launch(kernel)[grid](...)` become `wrap_triton` nodes, and Inductor
  launches the kernels from its generated code with its own launcher, beside the kernels it generates.
  The host function therefore has to be traceable with fake tensors: shapes and Python ints only, no
  reads of tensor data or of an autotuner's choice, no launch options Inductor does not take
  (`launch_options` drops maxnreg while tracing). Every tensor a kernel writes must be passed whole,
  never as a view (pass the buffer and the view's strides): functionalization turns a written view into
  a clone of it and a copy back into its base, full-size copy kernels Inductor cannot remove (five per
  attention backward cost 4.3 ms per Swin-B step on the H200 until the attention kernels wrote whole
  buffers).
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


# Experimental, off by default: eager launches straight through the compiled kernel's launcher.
# On the H200's host a 41-argument no-op took 21.6 µs per launch through `kernel[grid](...)` and 5.9 µs
# through its launcher (benchmarks/bench_host.py --parts launch, 2026-12-01). Not yet validated on the
# GPU with the real kernels, hence the switch.
FAST_LAUNCH = os.environ.get("SWINBENCH_FAST_LAUNCH", "0") == "1"


def launch(kernel):
    """`launch(kernel)[grid](...)`: the kernel itself, or its `wrap_triton` wrapper while traced (or,
    with SWINBENCH_FAST_LAUNCH=1 on a GPU, a `CachedLauncher` around it)."""
    if tracing():
        return torch.library.wrap_triton(kernel)
    if FAST_LAUNCH and not _INTERPRET:
        return _cached_launcher(kernel)
    return kernel


def specialization_key(args: tuple) -> tuple:
    """What Triton specializes a compiled kernel on, for positional arguments, in cheap Python: a
    tensor's dtype and whether its address is 16-byte aligned; an int's width class (i32, i64, u64),
    whether it equals 1 and whether 16 divides it; for anything else (floats, bools, None) its type.
    Conservative: arguments marked do_not_specialize are keyed too, which only costs extra entries."""
    return tuple(
        (a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor)
        else (a == 1, a % 16 == 0, -2**31 <= a < 2**31, a >= 2**63) if type(a) is int
        else type(a)
        for a in args)


class CachedLauncher:
    """`kernel[grid]` for eager calls that launches through the compiled kernel's own launcher: a miss
    goes through `kernel[grid](...)` (binding, specialization, compile) and keeps the CompiledKernel it
    returns, keyed on the grid, `specialization_key` of the positional arguments and the keyword
    arguments (constexprs and launch options, which must be hashable); a hit calls the launcher as the
    end of `JITFunction.run` does. A callable grid takes the plain path."""

    def __init__(self, kernel):
        from triton import knobs

        self.kernel = kernel
        self.cache: dict = {}
        self.runtime = knobs.runtime  # its launch hooks are read at each launch, as Triton reads them

    def __getitem__(self, grid):
        if callable(grid):
            return self.kernel[grid]
        return functools.partial(self._launch, tuple(grid) + (1,) * (3 - len(grid)), grid)

    def _launch(self, grid3, grid, *args, **kwargs):
        device, stream = _device_stream()
        key = (device, grid3, specialization_key(args), tuple(kwargs.items()))
        hit = self.cache.get(key)
        if hit is None:
            compiled = self.kernel[grid](*args, **kwargs)
            # the arguments after the positional ones, in signature order: passed by keyword or defaulted
            tail = tuple((p.name, p.default) for p in self.kernel.params[len(args):])
            missing = [n for n, d in tail if n not in kwargs and d is inspect.Parameter.empty]
            if compiled is not None and not missing:
                self.cache[key] = (compiled, tail)
            return compiled
        compiled, tail = hit
        values = args + tuple(kwargs.get(n, d) for n, d in tail)
        # as JITFunction.run ends: launch metadata and hooks exactly as Triton passes them (a profiler's
        # hooks see these launches too)
        compiled.run(grid3[0], grid3[1], grid3[2], stream, compiled.function, compiled.packed_metadata,
                     compiled.launch_metadata(grid, stream, *values),
                     self.runtime.launch_enter_hook, self.runtime.launch_exit_hook, *values)
        return compiled


def _device_stream() -> tuple:
    """(current device, its current stream), as Triton's own launch path reads them."""
    from triton.runtime.driver import driver

    device = driver.active.get_current_device()
    return device, driver.active.get_current_stream(device)


@functools.lru_cache(maxsize=None)
def _cached_launcher(kernel):
    """The kernel's CachedLauncher (one per kernel); autotuned kernels stay as they are."""
    from triton.runtime.jit import JITFunction

    return CachedLauncher(kernel) if isinstance(kernel, JITFunction) else kernel


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
