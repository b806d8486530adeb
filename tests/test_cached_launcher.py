"""The cached launcher (on by default on the Triton releases it was checked on; SWINBENCH_FAST_LAUNCH):
its specialization key separates everything Triton specializes on; a miss goes through kernel[grid] and a hit calls the compiled
kernel's launcher with the arguments in signature order and Triton's launch hooks; callable grids and
autotuned kernels are cached too (checked on the CPU with stand-in kernels);
on a GPU every kernel launched through it gives bit-for-bit the plain launch's results."""
import importlib
import inspect
import os
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ops = importlib.import_module("workbench.kernels._common")  # noqa: E402


def test_specialization_key_separates_what_triton_specializes_on():
    """Equal keys must mean the same specialization: tensors by dtype and 16-byte alignment, ints by value
    (finer than Triton's classes: 1, multiples of 16, i32/i64/u64), floats not at all; a bool is not the
    int 1 and None is not 0."""
    key = ops.specialization_key
    base = torch.zeros(64)
    assert key((base,)) == key((torch.ones(64),))                       # same dtype, both aligned
    assert key((base,)) != key((base[1:],))                             # 4-byte offset: not 16-aligned
    assert key((base,)) != key((base.half(),))
    assert key((3,)) == key((3,)) and key((3,)) != key((5,))
    assert len({key((1,)), key((3,)), key((32,)), key((2**31,)), key((2**63,))}) == 5
    assert key((0.5,)) == key((1e-5,))                                  # floats are not specialized
    assert key((True,)) != key((1,)) and key((None,)) != key((0,))
    assert key((False,)) != key((0,))
    # a tuple argument: Triton specializes each item, so its items are keyed (a cached kernel compiled for
    # an i32 item must not be launched with an i64 one)
    assert key(((0, 2**40),)) != key(((2**40, 2**40),)) and key(((3, base),)) == key(((3, torch.ones(64)),))


def test_the_cache_starts_over_past_its_bound(monkeypatch):
    monkeypatch.setattr(ops, "_device_stream", lambda: (0, "stream"))
    monkeypatch.setattr(ops, "MAX_CACHE_ENTRIES", 3)
    kernel = _Kernel()
    launcher = ops.CachedLauncher(kernel)
    x = torch.zeros(8)
    for n in range(5):
        launcher[(1,)](x, n, 4)
    assert len(launcher.cache) == 2 and len(kernel.plain_launches) == 5


class _Compiled:
    def __init__(self):
        self.calls, self.function, self.packed_metadata = [], "fn", "packed"

    def run(self, *args):
        self.calls.append(args)

    def launch_metadata(self, grid, stream, *args):
        return ("metadata", grid, stream)


class _Kernel:
    """Stands in for a JITFunction: params in signature order, kernel[grid](...) -> compiled."""

    def __init__(self):
        names = [("X", inspect.Parameter.empty), ("n", inspect.Parameter.empty),
                 ("BLOCK", inspect.Parameter.empty), ("FLAG", False)]
        self.params = [SimpleNamespace(name=n, default=d) for n, d in names]
        self.compiled, self.plain_launches = _Compiled(), []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.plain_launches.append((grid, args, kwargs))
            return self.compiled
        return run


def test_miss_goes_through_the_kernel_and_a_hit_through_the_launcher(monkeypatch):
    monkeypatch.setattr(ops, "_device_stream", lambda: (0, "stream"))
    kernel = _Kernel()
    fast = ops.CachedLauncher(kernel)
    x = torch.zeros(16)
    fast[(4,)](x, 9, BLOCK=64, num_warps=4)                                 # miss
    assert len(kernel.plain_launches) == 1 and not kernel.compiled.calls
    fast[(4,)](x, 9, BLOCK=64, num_warps=4)                                 # hit: same arguments
    assert len(kernel.plain_launches) == 1
    (call,) = kernel.compiled.calls
    from triton import knobs

    assert call[:7] == (4, 1, 1, "stream", "fn", "packed", ("metadata", (4,), "stream"))
    assert call[7:9] == (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook)
    assert call[9:] == (x, 9, 64, False)                    # positional, then keyword, then the default
    fast[(4,)](x, 16, BLOCK=64, num_warps=4)                                # another n: a new entry
    fast[(4,)](x, 9, BLOCK=32, num_warps=4)                                 # another constexpr
    fast[(4,)](x, 9, BLOCK=64, num_warps=8)                                 # another launch option
    fast[(2, 3)](x, 9, BLOCK=64, num_warps=4)                               # another grid
    assert len(kernel.plain_launches) == 5 and len(kernel.compiled.calls) == 1


def test_a_constexpr_passed_positionally_is_keyed_on_its_value(monkeypatch):
    monkeypatch.setattr(ops, "_device_stream", lambda: (0, "stream"))
    kernel = _Kernel()
    for p in kernel.params:
        p.is_constexpr = p.name in ("BLOCK", "FLAG")
    fast = ops.CachedLauncher(kernel)
    x = torch.zeros(16)
    fast[(4,)](x, 7, 64)
    fast[(4,)](x, 7, 64)                                     # hit
    fast[(4,)](x, 7, 32)                                     # same type, another compiled-in value: a miss
    assert len(kernel.plain_launches) == 2 and len(kernel.compiled.calls) == 1


_SEEN: list = []


def test_callable_grids_are_keyed_on_what_they_close_over(monkeypatch):
    monkeypatch.setattr(ops, "_device_stream", lambda: (0, "stream"))
    kernel = _Kernel()
    fast = ops.CachedLauncher(kernel)
    _SEEN.clear()

    def make_grid(programs):
        def grid(meta):
            _SEEN.append(dict(meta))      # a global: the closure holds only `programs`
            return (programs * meta["BLOCK"], 2)
        return grid

    x = torch.zeros(16)
    fast[make_grid(3)](x, 5, BLOCK=8)                      # miss: plain launch, grid evaluated once
    fast[make_grid(3)](x, 5, BLOCK=8)                      # a new closure with equal values: a hit
    assert len(kernel.plain_launches) == 1 and len(kernel.compiled.calls) == 1
    assert _SEEN == [{"X": x, "n": 5, "BLOCK": 8, "FLAG": False}]
    assert kernel.compiled.calls[0][:3] == (24, 2, 1)
    fast[make_grid(4)](x, 5, BLOCK=8)                      # another closed-over value: another entry
    assert len(kernel.plain_launches) == 2 and len(fast.cache) == 2

    unhashable = [1]
    grid = lambda meta: (unhashable[0],)  # noqa: E731
    fast[grid](x, 3, BLOCK=8)
    fast[grid](x, 3, BLOCK=8)
    assert len(kernel.plain_launches) == 4 and len(fast.cache) == 2   # plain path, nothing cached


class _Config:
    def __init__(self, kwargs, pre_hook=None):
        self.kwargs, self.pre_hook = kwargs, pre_hook


class _Autotuned:
    """Stands in for triton.autotune around a JITFunction: kernel[grid](...) picks `choice` and launches
    the inner kernel with its values, setting best_config."""

    def __init__(self, choice):
        self.fn = _Kernel()
        self.params = self.fn.params
        self.configs, self.choice, self.best_config = [choice], choice, None

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.best_config = self.choice
            meta = {p.name: a for p, a in zip(self.params, args)} | kwargs | self.choice.kwargs
            return self.fn[grid(meta) if callable(grid) else grid](*args, **kwargs, **self.choice.kwargs)
        return run


def test_autotuned_kernels_are_cached_with_their_chosen_config(monkeypatch):
    monkeypatch.setattr(ops, "_device_stream", lambda: (0, "stream"))
    chosen = _Config({"BLOCK": 32})
    kernel = _Autotuned(chosen)
    fast = ops.CachedLauncher(kernel)
    x = torch.zeros(16)
    grid = lambda meta: (64 // meta["BLOCK"],)  # noqa: E731
    fast[grid](x, 5)                                        # miss: the autotuner's path
    assert kernel.fn.plain_launches == [((2,), (x, 5), {"BLOCK": 32})]
    kernel.best_config = "another shape's choice"
    fast[grid](x, 5)                                        # hit: the chosen value fills BLOCK
    (call,) = kernel.fn.compiled.calls
    assert call[:3] == (2, 1, 1) and call[9:] == (x, 5, 32, False)
    assert kernel.best_config is chosen                      # as a real run leaves it

    hooked = _Autotuned(_Config({"BLOCK": 32}, pre_hook=lambda nargs: None))
    fast = ops.CachedLauncher(hooked)
    fast[grid](x, 5)
    fast[grid](x, 5)
    assert len(hooked.fn.plain_launches) == 2 and not fast.cache


def test_on_by_default_only_where_checked_and_never_under_the_interpreter():
    assert ops.fast_launch_default(None, "3.6.0") and ops.fast_launch_default("", "3.6.1")
    assert not ops.fast_launch_default(None, "3.8.0") and not ops.fast_launch_default(None, None)
    assert ops.fast_launch_default("1", "3.8.0") and not ops.fast_launch_default("0", "3.6.0")
    assert ops.FAST_LAUNCH == ops.fast_launch_default(os.environ.get("SWINBENCH_FAST_LAUNCH"), ops._triton_version())
    if ops._INTERPRET:
        assert ops.launcher_name() == "interpreter"
        win = importlib.import_module("workbench.kernels.window")
        assert ops.launch(win._partition_fwd_kernel) is win._partition_fwd_kernel


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_real_kernels_match_the_plain_launch_bit_for_bit(monkeypatch):
    """Fused window ops, LayerNorm, the bias gradient and window attention (autotuned, callable grids),
    forward and backward, twice (the second call hits the cache), with the cached launcher against plain
    launches: equal to the bit."""
    win = importlib.import_module("workbench.kernels.window")
    ln = importlib.import_module("workbench.kernels.layer_norm")
    lin = importlib.import_module("workbench.kernels.linear")
    wa = importlib.import_module("workbench.kernels.window_attention")
    ops._cached_launcher.cache_clear()

    def run_all(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        r = lambda *s, dt=torch.bfloat16: torch.randn(*s, device="cuda", dtype=dt, generator=g)  # noqa: E731
        B, H, W, C = 2, 13, 11, 96
        x, w, b = r(B, H, W, C).requires_grad_(), r(C).requires_grad_(), r(C).requires_grad_()
        sc = r(B, H, W, C).requires_grad_()
        y = win.norm_shift_partition(x, w, b, 1e-5, 7, 3)
        z = win.merge_unshift_add(y * 1.5, sc, 7, 3, H, W)
        rows = r(37, C).requires_grad_()
        n = ln.layer_norm(rows, w, b, 1e-5)
        (z.float().square().sum() + n.float().square().sum()).backward()
        dy, pre = r(300, 130), r(300, 130)
        # window attention: autotuned kernels with callable grids, packed qkv and separate q, k, v
        qkv, bias = r(12, 49, 3, 3, 32).requires_grad_(), r(3, 49, 49, dt=torch.float32).requires_grad_()
        mask = r(4, 49, 49, dt=torch.float32)
        a1 = wa.fused_window_attention_qkv(qkv, bias, mask)
        q, k, v = (r(10, 2, 49, 32).requires_grad_() for _ in range(3))
        a2 = wa.fused_window_attention(q, k, v, bias[:2].detach(), None)
        (a1.float().square().sum() + a2.float().square().sum()).backward()
        out = [y, z, n, x.grad, w.grad, b.grad, sc.grad, rows.grad, *lin.bias_grad_host(dy, pre, torch.bfloat16),
               a1, a2, qkv.grad, bias.grad, q.grad, k.grad, v.grad]
        return [t.detach().clone() for t in out]

    plain = [run_all(s) for s in (1, 2)]
    monkeypatch.setattr(ops, "FAST_LAUNCH", True)
    fast = [run_all(s) for s in (1, 2)]
    for p, f in zip(plain, fast):
        for a, b in zip(p, f):
            assert torch.equal(a, b)
    kernels = [win._partition_fwd_kernel, win._merge_fwd_kernel, win._norm_partition_bwd_kernel,
               ln._layer_norm_fwd_kernel, ln._layer_norm_bwd_kernel, lin._bias_grad_kernel, wa._fwd,
               wa._bwd_kernel(64)]  # N = 49: the backward whose configs choose the query-tile height
    for k in kernels:   # each went through its launcher, and the second seed's calls hit its cache
        assert isinstance(ops.launch(k), ops.CachedLauncher) and ops.launch(k).cache, k


def test_pdl_default_and_launch_options(monkeypatch):
    """Programmatic dependent launch: on by default only where supported; SWINBENCH_PDL=0 turns it off, =1
    cannot turn it on where unsupported; the launch keyword is dropped while traced (Inductor's launcher)."""
    from workbench.kernels import _common as _ops

    assert _ops.pdl_default(None, True) and not _ops.pdl_default(None, False)
    assert not _ops.pdl_default("0", True) and _ops.pdl_default("1", True) and not _ops.pdl_default("1", False)
    assert _ops.launch_options(None, True) == {"launch_pdl": True}
    assert _ops.launch_options(64, False) == {"maxnreg": 64}
    monkeypatch.setattr(_ops._STATE, "tracing", True, raising=False)
    assert _ops.launch_options(64, True) == {} and not _ops.pdl_launch()


def test_debugging_variables_are_read_in_one_place_and_all_documented(monkeypatch):
    """The kernels read their SWINBENCH_* variables through _common.debug_env only (stripped, empty as
    unset, unknown names refused), and docs/debugging.md lists every SWINBENCH_* variable the code names."""
    import pathlib
    import re

    monkeypatch.setenv("SWINBENCH_PDL", " 0 ")
    monkeypatch.setenv("SWINBENCH_AUTOTUNE", "")
    assert ops.debug_env("SWINBENCH_PDL") == "0" and ops.debug_env("SWINBENCH_AUTOTUNE") is None
    with pytest.raises(KeyError):
        ops.debug_env("SWINBENCH_NO_SUCH")
    root = pathlib.Path(__file__).resolve().parents[1]
    for path in (root / "workbench" / "kernels").glob("*.py"):
        if path.name != "_common.py":
            assert "os.environ" not in path.read_text(), f"{path.name} reads the environment itself"
    named = {m for p in [root / "cli.py", *(root / "workbench").rglob("*.py")]
             for m in re.findall(r"SWINBENCH_[A-Z_]+", p.read_text())}
    assert set(ops.DEBUG_VARIABLES) <= named
    doc = (root / "docs" / "debugging.md").read_text()
    assert not [n for n in sorted(named) if f"`{n}`" not in doc]
