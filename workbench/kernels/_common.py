"""What the kernel modules share, below all of them: no kernel module imports another.

Launching (host side):
  kernel_op        a host function (allocate outputs, launch Triton) as a plain call in eager mode and a
                   torch.library operator while torch.compile traces (see Operators below)
  launch           `launch(kernel)[grid](...)`: the kernel, its CachedLauncher in eager mode (FAST_LAUNCH),
                   or its wrap_triton wrapper while traced
  launch_options   maxnreg and programmatic dependent launch (pdl_launch, pdl_supported)
  launch_log       every eager launch inside a `with` block, with its arguments' bytes (argument_bytes):
                   what the profile's kernel floors are computed from
Inside kernels (triton.jit): pdl_enter / pdl_exit, to_dtype (rounds to nearest even, by hand under the
interpreter: SOFT_RTNE), zero_column_sums, emit_column_sum.
Column sums, what a backward adds up over rows (LayerNorm dweight/dbias, a Linear's bias gradient):
  column_sums, eager_column_sums, finish_column_sums, sum_rows, sum_partials, split_column_sums,
  split_norm_grads.
Buffers and sizes: new_output (every buffer a kernel writes), sm_count, cdiv, next_pow2; host_cache, the
cache of the launch-configuration helpers.

Operators. Each host function is registered as a `torch.library` operator so that torch.compile can put
it in its graph. Two registrations:

* `torch.library.triton_op` (a GPU with compiled Triton): AOTAutograd traces the host function
  itself, its launches written as `launch(kernel)[grid](...)` become `wrap_triton` nodes, and Inductor
  launches the kernels from its generated code with its own launcher, beside the kernels it generates.
  The host function therefore has to be traceable with fake tensors: shapes and Python ints only, no
  reads of tensor data or of an autotuner's choice, no launch options Inductor does not take
  (`launch_options` drops maxnreg while tracing). Every tensor a kernel writes must be passed whole,
  never as a view (pass the buffer and the view's strides): functionalization turns a written view into
  a clone of it and a copy back into its base, full-size copy kernels Inductor cannot remove.
* `torch.library.custom_op` (Triton's CPU interpreter, no GPU, or symbolic shapes): one opaque node per
  call with a fake implementation for shapes; at run time the compiled graph calls back into the
  dispatcher and the Python host function.

In eager mode either op's dispatcher path (schema binding, the autograd fallback, aliasing checks)
costs host time on every call on top of the launch, for nothing: the op has no autograd formula of its
own (the autograd Functions wrap it). So the entry point calls the host function straight when nothing
is compiling and the op when Dynamo traces.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
import statistics
import threading
from typing import Callable

import torch
import triton
import triton.language as tl

_STATE = threading.local()
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# The SWINBENCH_* debugging variables of the kernels and what each does (docs/debugging.md lists every
# SWINBENCH_* variable). debug_env below is the only reader; the kernels read them once, at import.
DEBUG_VARIABLES = {
    "SWINBENCH_AUTOTUNE": "0: one launch configuration per window-attention kernel instead of autotuning",
    "SWINBENCH_PDL": "0: no programmatic dependent launch for the window kernels (on where the GPU and Triton "
                     "support it)",
    "SWINBENCH_FAST_LAUNCH": "1 / 0: eager launches through the cached launcher forced on / off (by default on "
                             "for the Triton releases in FAST_LAUNCH_CHECKED)",
}


def debug_env(name: str) -> str | None:
    """The value of the debugging variable `name` (one of DEBUG_VARIABLES) in this process's environment,
    stripped; None where it is unset or empty."""
    if name not in DEBUG_VARIABLES:
        raise KeyError(f"{name} is not one of the kernels' debugging variables")
    value = os.environ.get(name, "").strip()
    return value or None


# Autotune the window-attention kernels (window_attention.py); SWINBENCH_AUTOTUNE=0 pins one
# configuration each (the tests set it: correctness, not speed, and no tuning time).
AUTOTUNE = debug_env("SWINBENCH_AUTOTUNE") != "0"


COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)   # what the kernels compute in


def require_compute_dtype(what: str, *tensors) -> None:
    """ValueError unless every tensor given (None skipped) is fp16, bf16 or fp32: the kernels compute in
    fp32 at most, so an fp64 input would come back at fp32's precision."""
    for t in tensors:
        if t is not None and t.dtype not in COMPUTE_DTYPES:
            raise ValueError(f"{what}: got {t.dtype}; the kernels take float16, bfloat16 or float32")


def cdiv(a: int, b: int) -> int:
    """Ceiling division for the host code's grids and tile counts. Newer Triton makes `triton.cdiv` and
    `triton.next_power_of_2` constexpr functions, which cost host time per call through their wrapper;
    this is plain integer arithmetic."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1), as `triton.next_power_of_2` on the host."""
    return 1 << (n - 1).bit_length()


def triton_ops_enabled() -> bool:
    """Whether operators are registered as triton_ops (Inductor launches the kernels) rather than opaque
    custom ops: wherever torch has triton_op and a GPU runs compiled Triton. Off under Triton's CPU
    interpreter (Inductor cannot compile the kernels for the CPU)."""
    return not _INTERPRET and hasattr(torch.library, "triton_op") and torch.cuda.is_available()


def tracing() -> bool:
    """True while a triton_op's host function runs under AOTAutograd's tracing (fake tensors)."""
    return getattr(_STATE, "tracing", False)


# Eager launches straight through the compiled kernel's launcher (CachedLauncher): `kernel[grid](...)`
# binds and specializes every argument in Python at each launch, which costs the host several times
# what the launch itself does, and an eager Swin step is bound by the host. The launcher calls Triton's
# compiled kernel the way that Triton's own `JITFunction.run` does, an interface that changes between
# Triton releases, so it is on by default only on the releases where every kernel matched plain
# launches bit for bit on a GPU (tests/test_cached_launcher.py); SWINBENCH_FAST_LAUNCH=1 / 0 forces it
# on / off (a debugging aid: another release, or a suspected launcher problem).
FAST_LAUNCH_CHECKED = ("3.6.",)


def fast_launch_default(env: str | None, triton_version: str | None) -> bool:
    """Whether the cached launcher is on: as SWINBENCH_FAST_LAUNCH says ("1" / "0") or, unset, on the
    Triton releases in FAST_LAUNCH_CHECKED."""
    if env is not None and env.strip() != "":
        return env.strip() == "1"
    return triton_version is not None and triton_version.startswith(FAST_LAUNCH_CHECKED)


def _triton_version() -> str | None:
    return getattr(triton, "__version__", None)


# Whether eager launches go through the cached launcher in this process.
FAST_LAUNCH = fast_launch_default(debug_env("SWINBENCH_FAST_LAUNCH"), _triton_version())


def launcher_name() -> str:
    """How eager code launches the Triton kernels here, for records: 'cached' (CachedLauncher),
    'triton' (`kernel[grid](...)`), or 'interpreter' (Triton's CPU interpreter)."""
    return "interpreter" if _INTERPRET else ("cached" if FAST_LAUNCH else "triton")


def launch(kernel):
    """`launch(kernel)[grid](...)`: the kernel itself, or its `wrap_triton` wrapper while traced (with the
    kernel's defaults filled in: _TracedLaunch), or a `CachedLauncher` around it where FAST_LAUNCH is on
    (not under the interpreter). Inside `launch_log()` an eager launch is also written into the log."""
    if tracing():
        return _TracedLaunch(kernel)
    target = _cached_launcher(kernel) if FAST_LAUNCH and not _INTERPRET else kernel
    return target if _LAUNCH_LOG is None else _LoggedLaunch(target, kernel, _LAUNCH_LOG)


def kernel_name(kernel) -> str:
    """The name a GPU trace gives the kernel: its Python function's name (through autotuners/heuristics)."""
    fn = kernel
    while not inspect.isfunction(fn) and hasattr(fn, "fn"):
        fn = fn.fn
    return getattr(fn, "__name__", type(kernel).__name__)


def argument_bytes(args, kwargs) -> tuple[int, list]:
    """(bytes of the distinct tensors among a launch's arguments, each counted once, [[shape], dtype] of
    each): what a kernel that reads or writes every element of every argument once must move at least.
    Views of one buffer count by their own extent; the same view passed twice counts once."""
    seen, total, tensors = set(), 0, []
    for value in (*args, *kwargs.values()):
        if not isinstance(value, torch.Tensor):
            continue
        key = (value.data_ptr(), tuple(value.shape), tuple(value.stride()), value.dtype)
        if key in seen:
            continue
        seen.add(key)
        total += value.numel() * value.element_size()
        tensors.append([list(value.shape), str(value.dtype).replace("torch.", "")])
    return total, tensors


class _LoggedLaunch:
    """`target[grid](...)` that first appends {kernel, bytes, tensors} to the active launch log."""

    def __init__(self, target, kernel, log: list):
        self.target, self.kernel, self.log = target, kernel, log

    def __getitem__(self, grid):
        run = self.target[grid]

        def logged(*args, **kwargs):
            nbytes, tensors = argument_bytes(args, kwargs)
            entry = {"kernel": kernel_name(self.kernel), "bytes": nbytes, "tensors": tensors}
            self.log.append(entry)
            out = run(*args, **kwargs)
            config = config_label(self.kernel)
            if config:
                entry["config"] = config
            return out
        return logged


def config_label(kernel) -> str | None:
    """The launch configuration an autotuned kernel last ran with ('G=8 BLOCK_M=16 warps=4 stages=2'), as its
    autotuner chose it; None for a kernel without an autotuner (or before its first run)."""
    config = getattr(kernel, "best_config", None)
    if config is None:
        return None
    parts = [f"{k}={v}" for k, v in config.kwargs.items()]
    parts += [f"{short}={getattr(config, k)}" for k, short in (("num_warps", "warps"), ("num_stages", "stages"),
                                                               ("maxnreg", "maxnreg")) if getattr(config, k, None)]
    return " ".join(parts)


_LAUNCH_LOG: list | None = None     # the active launch_log's list: every thread's launches (autograd's too)


_AS_COMPILED = [False]


def traced() -> bool:
    """Whether code with a compiled and an eager branch takes the compiled one: while Dynamo traces it, and
    inside `as_compiled`, where a step run eagerly stands in for the compiled step (the profile's kernel
    floors log its launches) and so launches swinbench's kernels as the compiled step does."""
    return torch.compiler.is_compiling() or _AS_COMPILED[0]


@contextlib.contextmanager
def as_compiled():
    """Within the block, `traced()` is true: eager code takes torch.compile's branches (timm's stage and
    merging forwards unless the compile pass's fused_window keeps the fused chain, the operators' host
    functions, torch's sums and multiplies where Inductor would fuse them), so a forced-eager step
    launches swinbench's kernels with the arguments and in the order the compiled step launches them."""
    previous, _AS_COMPILED[0] = _AS_COMPILED[0], True
    try:
        yield
    finally:
        _AS_COMPILED[0] = previous


@contextlib.contextmanager
def launch_log():
    """Collect the eager Triton launches made inside the block, from any thread (a backward's launches come
    from autograd's): yields the list it fills, one {kernel, bytes, tensors} per launch in launch order
    (see argument_bytes). Launches Inductor makes from compiled code and the autotuner's trial runs are
    not in it."""
    global _LAUNCH_LOG
    previous, _LAUNCH_LOG = _LAUNCH_LOG, []
    try:
        yield _LAUNCH_LOG
    finally:
        _LAUNCH_LOG = previous


@functools.lru_cache(maxsize=None)
def _kernel_defaults(kernel) -> tuple[tuple[str, ...], dict]:
    """(parameter names, {name: default}) of a Triton kernel's Python signature, leaving out parameters an
    autotuner's configs set (it fills those in itself)."""
    fn = kernel
    while not inspect.isfunction(fn):  # Autotuner / Heuristics -> JITFunction -> the Python function
        fn = fn.fn
    params = inspect.signature(fn).parameters
    tuned = {k for cfg in getattr(kernel, "configs", ()) for k in cfg.kwargs}
    return tuple(params), {name: p.default for name, p in params.items()
                           if p.default is not inspect.Parameter.empty and name not in tuned}


def with_kernel_defaults(kernel, args: tuple, kwargs: dict) -> dict:
    """kwargs plus the kernel's default values for the parameters the call leaves out. Triton's launcher
    applies a kernel's defaults itself, but torch.compile's `wrap_triton` path does not: traced without
    them, its analysis of which tensors the kernel writes fails, it assumes every input is written, and
    AOTAutograd then refuses a parameter that requires grad (a LayerNorm weight) as a written input."""
    names, defaults = _kernel_defaults(kernel)
    given = set(names[:len(args)]) | set(kwargs)
    missing = {k: v for k, v in defaults.items() if k not in given}
    return {**kwargs, **missing} if missing else kwargs


class _TracedLaunch:
    """`wrap_triton(kernel)[grid](*args, **kwargs)` with the kernel's defaults filled in
    (with_kernel_defaults)."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        wrapped = torch.library.wrap_triton(self.kernel)[grid]

        def call(*args, **kwargs):
            return wrapped(*args, **with_kernel_defaults(self.kernel, args, kwargs))
        return call


def specialization_key(args: tuple) -> tuple:
    """A key under which equal argument lists get the same compiled kernel, in cheap Python: a tensor's
    dtype and whether its address is 16-byte aligned; an int's value; a tuple's items keyed so (Triton
    specializes each item); for anything else (floats, bools, None) its type. Triton specializes an int
    only on its width class, whether it is 1 and whether 16 divides it, so keying on the value is finer
    than needed (one entry per shape, where the kernels' ints are sizes and strides) and cheaper than
    computing those classes on every launch. Conservative: arguments marked do_not_specialize are keyed
    too, which only costs extra entries."""
    return tuple([  # a list comprehension: no generator frame per argument
        (a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else a if type(a) is int
        else specialization_key(a) if type(a) is tuple else type(a)
        for a in args])


# Entries one CachedLauncher keeps before it starts over: the kernels' int arguments are sizes and strides,
# a handful of shapes per model, so this bounds only a caller that passes ever-new ints.
MAX_CACHE_ENTRIES = 4096


class CachedLauncher:
    """`kernel[grid]` for eager calls that launches through the compiled kernel's own launcher: a miss
    goes through `kernel[grid](...)` (binding, specialization, autotuning, compile) and keeps the
    CompiledKernel it returns, keyed on the grid, `specialization_key` of the positional arguments, the
    values of any constexprs among them, and the keyword arguments (constexprs and launch options, which
    must be hashable); a hit calls the launcher as the end of `JITFunction.run` does.

    An autotuned kernel (a `triton.autotune` around a JITFunction) is cached once its autotuner has
    chosen: the entry keeps the chosen config, whose values fill the arguments the call leaves out, and a
    hit sets the autotuner's `best_config` to it as a real run would (host code reads it). Configs with
    a pre_hook take the plain path. A callable grid is keyed on its code and the values it closes over
    (a lambda over ints, as the host functions write them) and evaluated once, on the miss, with the
    arguments and the config; a grid closing over anything unhashable takes the plain path."""

    def __init__(self, kernel):
        from triton import knobs

        self.kernel = kernel
        self.autotuned = hasattr(kernel, "configs") and hasattr(kernel, "fn")
        self.params = (kernel.fn if self.autotuned else kernel).params
        # a constexpr passed positionally is compiled in: key on its value, not only on its type
        self.constexpr_positions = tuple(i for i, p in enumerate(self.params) if getattr(p, "is_constexpr", False))
        self.cache: dict = {}
        self.runtime = knobs.runtime  # its launch hooks are read at each launch, as Triton reads them

    def __getitem__(self, grid):
        if callable(grid):
            gkey = _grid_key(grid)
            if gkey is None:
                return self.kernel[grid]
            return functools.partial(self._launch, gkey, grid)
        return functools.partial(self._launch, tuple(grid), grid)

    def _launch(self, gkey, grid, *args, **kwargs):
        device, stream = _device_stream()
        key = (device, gkey, specialization_key(args), tuple(kwargs.items()),
               tuple(args[i] for i in self.constexpr_positions if i < len(args)))
        hit = self.cache.get(key)
        if hit is None:
            return self._miss(key, grid, args, kwargs)
        compiled, tail, grid_t, (g0, g1, g2), config = hit
        if config is not None:
            self.kernel.best_config = config
        values = args + tuple(kwargs.get(n, d) for n, d in tail)
        # as JITFunction.run ends: launch metadata and hooks exactly as Triton passes them (a profiler's
        # hooks see these launches too)
        compiled.run(g0, g1, g2, stream, compiled.function, compiled.packed_metadata,
                     compiled.launch_metadata(grid_t, stream, *values),
                     self.runtime.launch_enter_hook, self.runtime.launch_exit_hook, *values)
        return compiled

    def _miss(self, key, grid, args, kwargs):
        compiled = self.kernel[grid](*args, **kwargs)
        if compiled is None:
            return compiled
        config, chosen = None, {}
        if self.autotuned:
            config = self.kernel.best_config
            if config.pre_hook is not None:
                return compiled
            chosen = config.kwargs
        # the arguments after the positional ones, in signature order: passed by keyword, chosen by the
        # autotuner or defaulted
        tail = tuple((p.name, chosen.get(p.name, p.default)) for p in self.params[len(args):])
        if any(n not in kwargs and d is inspect.Parameter.empty for n, d in tail):
            return compiled
        if callable(grid):
            meta = {p.name: a for p, a in zip(self.params, args)}
            meta.update((n, kwargs.get(n, d)) for n, d in tail)
            grid = grid(meta)
        grid_t = tuple(grid)
        if len(self.cache) >= MAX_CACHE_ENTRIES:
            self.cache.clear()
        self.cache[key] = (compiled, tail, grid_t, grid_t + (1,) * (3 - len(grid_t)), config)
        return compiled


def _grid_key(grid) -> tuple | None:
    """A callable grid's cache key: its code and the values it closes over and defaults to, or None
    where one of them is not hashable (the grid could then change between calls with equal keys)."""
    code = getattr(grid, "__code__", None)
    if code is None:
        return None
    try:
        key = (code, tuple(c.cell_contents for c in grid.__closure__ or ()), grid.__defaults__)
        hash(key)
    except (TypeError, ValueError):
        return None
    return key


_GET_DEVICE = getattr(torch._C, "_cuda_getDevice", None)
_GET_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _device_stream() -> tuple:
    """(current device, its current stream), as Triton's own launch path reads them: torch's current
    device and raw stream, called straight (Triton's CUDA driver wraps the same two calls in
    `torch.cuda.current_device` and a property lookup per launch); through Triton's driver where this
    torch lacks them."""
    if _GET_STREAM is not None and _GET_DEVICE is not None:
        device = _GET_DEVICE()
        return device, _GET_STREAM(device)
    from triton.runtime.driver import driver

    device = driver.active.get_current_device()
    return device, driver.active.get_current_stream(device)


@functools.lru_cache(maxsize=None)
def _cached_launcher(kernel):
    """The kernel's CachedLauncher (one per kernel): a JITFunction or an autotuner straight around one;
    anything else (heuristics, nested wrappers) stays as it is."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, JITFunction) or (isinstance(kernel, Autotuner) and isinstance(kernel.fn, JITFunction)):
        return CachedLauncher(kernel)
    return kernel


def launch_options(maxnreg: int | None = None, pdl: bool = False) -> dict:
    """Extra launch keywords: maxnreg, and launch_pdl where `pdl` (the caller's `pdl_launch()`), except
    while traced (Inductor's launcher takes only num_warps, num_stages and the like, so a traced kernel
    runs without the register cap and without programmatic dependent launch)."""
    if tracing():
        return {}
    opts = {} if maxnreg is None else {"maxnreg": maxnreg}
    if pdl:
        opts["launch_pdl"] = True
    return opts


def _pdl_supported() -> bool:
    """Programmatic dependent launch: Hopper or newer, a Triton with `launch_pdl` and griddepcontrol
    (`triton.language.extra.cuda.gdc_wait`), compiled kernels (not the interpreter)."""
    if _INTERPRET or not torch.cuda.is_available():
        return False
    try:
        from triton.language.extra import cuda as tl_cuda
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    if not hasattr(tl_cuda, "gdc_wait") or "launch_pdl" not in getattr(CUDAOptions, "__dataclass_fields__", {}):
        return False
    return torch.cuda.get_device_capability()[0] >= 9


def pdl_default(env: str | None, supported: bool) -> bool:
    """Whether the window kernels launch with programmatic dependent launch: SWINBENCH_PDL=1 / 0 forces it
    on / off (on only where supported), unset it is on where supported."""
    if env is not None and env.strip() != "":
        return env.strip() == "1" and supported
    return supported


_PDL_SUPPORTED: bool | None = None
_PDL_ENV = debug_env("SWINBENCH_PDL")


def pdl_supported() -> bool:
    global _PDL_SUPPORTED
    if _PDL_SUPPORTED is None:
        _PDL_SUPPORTED = _pdl_supported()
    return _PDL_SUPPORTED


# Whether the window kernels launch with programmatic dependent launch in this process: None until the
# first launch sets it to pdl_default(SWINBENCH_PDL, pdl_supported()) (the GPU is not queried at import).
# A test or benchmark that sets it True must check pdl_supported() first.
PDL_LAUNCH: bool | None = None


def pdl_launch() -> bool:
    """Whether a kernel launched now takes programmatic dependent launch (its PDL constexpr and
    `launch_options(pdl=...)`): PDL_LAUNCH, never while traced."""
    global PDL_LAUNCH
    if tracing():
        return False
    if PDL_LAUNCH is None:
        PDL_LAUNCH = pdl_default(_PDL_ENV, pdl_supported())
    return PDL_LAUNCH


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


def cuda_graph_us(fns: list[Callable[[], object]], *, replays: int = 20, calls: int = 16) -> tuple[float, float, float]:
    """(median, p20, p80) GPU microseconds per call, host launch cost excluded.

    `fns` (one closure per input set, rotated so repeated calls don't just hit the L2) are called
    round robin: two warm-up rounds on a side stream (autotuning and allocation happen there), then
    `calls` calls captured into one CUDA graph whose replays are timed with CUDA events. A closure
    must be capturable: no host synchronization, no new allocations that outlive it.
    """
    rounds = -(-calls // len(fns))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for fn in fns:
                fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for fn in fns:
                fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / (rounds * len(fns)))
    del graph
    q = statistics.quantiles(times, n=10, method="inclusive")
    return statistics.median(times), q[1], q[7]


# ---------------------------------------------------------------------------------------------------------
# Device side: jit functions the kernels call, and the kernel that adds up column sums.

# Triton's CPU interpreter (TRITON_INTERPRET=1, used by the tests) truncates fp32 -> bf16 instead of
# rounding to nearest even as the GPU (and torch) do; under the interpreter we round by hand so that
# the kernels' bf16 results match torch's bit for bit. GPU code is unchanged (plain .to()).
SOFT_RTNE = _INTERPRET


if not _INTERPRET:
    try:
        import triton.language.extra.cuda  # noqa: F401  (griddepcontrol: tl.extra.cuda.gdc_*)
    except ImportError:
        pass


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Under programmatic dependent launch (the host's `pdl_launch()`), before any load or store: wait until
    the previous kernel in the stream has finished and its writes are visible."""
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_exit(PDL: tl.constexpr):
    """After the program's last store is issued: let the next kernel's programs start launching (they wait
    in their own pdl_enter). Its launch and the scheduling of its programs then overlap this kernel's
    tail instead of following it. Released at once instead (in pdl_enter), the next kernel's waiting
    programs would take SM slots from this one's and slow it down."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


# torch dtype -> Triton dtype, for a dtype passed to a kernel as a constexpr
TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def to_dtype(y, dtype: tl.constexpr, SOFT_RTNE: tl.constexpr):
    """Cast y to dtype, rounding to nearest even (by hand for bf16 under the interpreter)."""
    out = y.to(dtype)
    if SOFT_RTNE:
        if dtype == tl.bfloat16:
            yf = y.to(tl.float32)
            u = yf.to(tl.uint32, bitcast=True)
            u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
            out = tl.where(yf != yf, out, u.to(tl.uint16).to(tl.bfloat16, bitcast=True))
    return out


@triton.jit
def zero_column_sums(SUMS, n_sums, pid, n_programs, ZERO: tl.constexpr, BLOCK: tl.constexpr):
    """With ZERO, the programs of a forward kernel zero the (n_sums,) fp32 buffer that the backward will
    add its column sums into (`eager_column_sums`), BLOCK elements each in turn (one block for most, as
    a buffer of several rows is larger than one): the backward then needs no memset launch of its own."""
    if ZERO:
        for start in range(pid * BLOCK, n_sums, n_programs * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            tl.store(SUMS + offs, tl.zeros([BLOCK], dtype=tl.float32), mask=offs < n_sums)


@triton.jit
def emit_column_sum(SUMS, pid, row_len, cols, val, mask, ATOMIC: tl.constexpr):
    """A program's fp32 column sums `val` at columns `cols` of the buffer from `column_sums`: added
    atomically into its single row (ATOMIC), or stored in row `pid` of the partials (deterministic)."""
    if ATOMIC:
        tl.atomic_add(SUMS + cols, val, mask=mask, sem="relaxed")
    else:
        tl.store(SUMS + pid * row_len + cols, val, mask=mask)


@triton.jit
def _sum_partials_kernel(PARTIAL, OUT, n_partials, n_cols, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                         SOFT_RTNE: tl.constexpr = False, PDL: tl.constexpr = False):
    """OUT[c] = sum_p PARTIAL[p, c] in fp32, p in increasing order per lane, rounded once to OUT's dtype;
    programs split the columns. PDL: launched with programmatic dependent launch (pdl_enter / pdl_exit)."""
    pdl_enter(PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for p0 in range(0, n_partials, BLOCK_P):
        parts = p0 + tl.arange(0, BLOCK_P)
        mask = (parts < n_partials)[:, None] & col_mask[None, :]
        acc += tl.load(PARTIAL + parts[:, None] * n_cols + cols[None, :], mask=mask, other=0.0)
    tl.store(OUT + cols, to_dtype(tl.sum(acc, axis=0), OUT.dtype.element_ty, SOFT_RTNE), mask=col_mask)
    pdl_exit(PDL)


# ---------------------------------------------------------------------------------------------------------
# Host side: output buffers, the device's size, column sums.


def new_output(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized tensor for a kernel to write. The kernel modules call it as `_common.new_output`,
    looked up at each call, so that a test can replace it with a NaN-filled allocator and check that the
    kernels write every element they return."""
    return torch.empty(shape, dtype=dtype, device=device)


def host_cache(fn: Callable) -> Callable:
    """functools.lru_cache for a launch-configuration helper (a pure function of sizes, dtypes and the
    device), bypassed while torch.compile traces: Dynamo traces through an lru_cache anyway, and warns on
    every compiled run that it does (the autograd Functions' forwards call these helpers), and a traced
    size may be symbolic."""
    cached = functools.lru_cache(maxsize=None)(fn)

    @functools.wraps(fn)
    def call(*args):
        if torch.compiler.is_compiling():
            return fn(*args)
        return cached(*args)

    call.cache_clear = cached.cache_clear
    return call


@host_cache
def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (queried once per device, not per call); 2 under the CPU
    interpreter, so that a few programs each loop over several blocks there too."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2


# Deterministic reduction of (G, N) partials: BLOCK_P partial rows x _SUM_BLOCK_N columns per step.
_SUM_BLOCK_P, _SUM_BLOCK_N = 32, 64


def column_sums(programs: int, n_cols: int, device: torch.device,
                into: torch.Tensor | None = None, slots: int = 1) -> tuple[torch.Tensor, bool]:
    """(buffer, atomic) for a backward kernel whose `programs` programs each sum n_cols fp32 column
    values over their rows (dweight/dbias, a bias gradient), written with `emit_column_sum`.

    By default one zeroed (1, n_cols) row that every program adds into atomically: a memset and no
    reduction launch (the reduction of (programs, n_cols) partials runs on only n_cols/64 programs).
    The order of the fp32 additions then varies from run to run, so with
    torch.use_deterministic_algorithms(True) each program stores its own row of a (programs, n_cols)
    buffer instead, which `finish_column_sums` adds in a fixed order. `into`: a zeroed contiguous
    fp32 tensor of n_cols elements to add into instead of a fresh one (a caller with several reductions
    zeroes one buffer for all of them: one memset instead of several); ignored in deterministic mode.

    slots > 1: (slots, n_cols) rows instead of one, which a kernel with many programs adds into in turn
    (program p into row p % slots), so that fewer atomic adds queue on each address; `finish_column_sums`
    then adds the rows up. `into` holds slots * n_cols elements, or n_cols (one row, whatever slots says:
    a caller that zeroes one buffer for several reductions)."""
    if torch.are_deterministic_algorithms_enabled():
        return new_output((programs, n_cols), torch.float32, device), False
    if into is not None:
        return into.view(-1 if into.numel() == slots * n_cols else 1, n_cols), True
    return torch.zeros((slots, n_cols), dtype=torch.float32, device=device), True


def eager_column_sums(n_cols: int, device: torch.device, ctx, *params, slots: int = 1) -> torch.Tensor | None:
    """For an autograd Function whose forward kernel can zero its backward's column-sum buffer: a fresh
    (slots * n_cols,) fp32 buffer for the forward to zero (`zero_column_sums`) and the backward to pass as
    `column_sums`' `into`, which saves the backward's memset launch (one per LayerNorm backward: 53 per
    eager Swin-B training step). None where that does not apply: no backward will follow (the Function's
    ctx.needs_input_grad is all False, as under no_grad), no parameter takes a gradient sum,
    deterministic algorithms are on (per-program partials instead), or torch.compile traces the forward
    (the operators' schemas stay as they are; Inductor schedules the memset). A Function keeps it on ctx
    and drops it after one backward, so a second backward through a retained graph gets a fresh one."""
    if (not any(ctx.needs_input_grad) or all(p is None for p in params)
            or torch.are_deterministic_algorithms_enabled() or traced()):
        return None
    return new_output((slots * n_cols,), torch.float32, device)


def finish_column_sums(sums: torch.Tensor, atomic: bool) -> torch.Tensor:
    """The (n_cols,) fp32 totals of a `column_sums` buffer after the kernel ran: its one atomic row, its
    atomic rows (slots) added up by `sum_rows`, or its per-program partials by `sum_partials`."""
    if atomic:
        return sums[0] if sums.shape[0] == 1 else sum_rows(sums, torch.float32)
    return sum_partials(sums)


_SUM_ROWS_ELEMS = 4096  # elements one sum_rows program adds per step
_SUM_ROWS_MAX_N = 1024  # columns a program at most (a plain cast: 1024 a program)


def sum_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(R, n) fp32 -> (n,) sums over R in dtype: one sum_partials launch (with PDL where on), on blocks sized
    for a few rows of atomic sums (slots) rather than many per-program partials (a single row: a plain
    cast, 1024 columns a program)."""
    block_r = min(next_pow2(rows.shape[0]), _SUM_ROWS_ELEMS // 32)
    block_n = max(32, min(_SUM_ROWS_MAX_N, _SUM_ROWS_ELEMS // block_r))
    return sum_partials(rows, dtype, block_p=block_r, block_n=block_n, pdl=pdl_launch())


def sum_partials(partial: torch.Tensor, dtype: torch.dtype = torch.float32, *, block_p: int = _SUM_BLOCK_P,
                 block_n: int = _SUM_BLOCK_N, pdl: bool = False) -> torch.Tensor:
    """(G, N) fp32 partial sums -> (N,) totals in dtype (added in fp32, rounded once), each column added over
    G in a fixed order (one launch; with programmatic dependent launch where `pdl`, the caller's
    pdl_launch())."""
    n_partials, n_cols = partial.shape
    out = new_output((n_cols,), dtype, partial.device)
    launch(_sum_partials_kernel)[(cdiv(n_cols, block_n),)](
        partial, out, n_partials, n_cols, BLOCK_P=block_p, BLOCK_N=block_n, SOFT_RTNE=SOFT_RTNE, PDL=pdl,
        num_warps=4, **launch_options(None, pdl))
    return out


def split_column_sums(sums: torch.Tensor, sizes: tuple, dtypes: tuple) -> list:
    """Consecutive slices of fp32 column sums, each in its parameter's dtype (None: no parameter, gives
    None): views where the dtype is fp32, one cast for all when every slice wants the same lower
    precision (master_weights' bf16 biases), a cast each otherwise."""
    if len(set(dtypes)) == 1 and dtypes[0] not in (None, torch.float32):
        return list(sums.to(dtypes[0]).split(sizes))
    return [None if t is None else (g if t == torch.float32 else g.to(t)) for g, t in zip(sums.split(sizes), dtypes)]


def split_norm_grads(sums: torch.Tensor, weight, bias) -> tuple:
    """(dweight, dbias) from a LayerNorm backward's (2C,) fp32 column sums (split_column_sums): views
    when the parameter is fp32 (autocast training keeps them so), cast copies otherwise; None for a
    missing parameter."""
    n_cols = sums.shape[0] // 2
    dw, db = split_column_sums(sums, (n_cols, n_cols), tuple(None if p is None else p.dtype for p in (weight, bias)))
    return dw, db
