"""The kernel entry points as operators: every swinbench::* op passes torch.library.opcheck (schema, fake
implementation against the real kernel's output shapes/strides/dtypes, AOT dispatch), the opaque custom
op everywhere and, on a GPU, the triton_op that torch.compile traces into; and
in eager mode the entry points run the host functions without going through the op at all."""
import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ln = importlib.import_module("workbench.kernels.layer_norm")  # noqa: E402
win = importlib.import_module("workbench.kernels.window")  # noqa: E402
wa = importlib.import_module("workbench.kernels.window_attention")  # noqa: E402
lin = importlib.import_module("workbench.kernels.linear")  # noqa: E402
cos = importlib.import_module("workbench.kernels.cosine")  # noqa: E402
from workbench.kernels._common import KernelOp  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# opcheck's default set: schema, autograd registration, fake tensor vs real output, AOT dispatch with
# dynamic shapes (the path torch.compile takes)
UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
UTILS_TRACED = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_static")


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEVICE, dtype=dtype)


def op_samples():
    B, H, W, C, ws, shift = 1, 9, 10, 24, 7, 3      # H, W not multiples of the window: padded
    x = rand(B, H, W, C)
    w, b = rand(C), rand(C)
    windows, mean, rstd = win.norm_shift_partition_fwd(x, w, b, 1e-5, ws, shift)
    rows = rand(37, C)
    _, y, m, r = ln.layer_norm_fwd(rows, None, w, b, 1e-5, rows.dtype)
    bnw, nh, n, d = 4, 2, 49, 16
    qkv = rand(bnw, n, 3, nh, d)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    bias, mask = rand(nh, n, n), rand(2, n, n)
    out, lse = wa.window_attention_fwd(q, k, v, bias, mask, d ** -0.5)
    dout = rand(bnw, nh, n, d)
    return [
        ("layer_norm_fwd", ln._layer_norm_fwd_op, (rows, w, b, 1e-5, torch.float32)),
        ("add_layer_norm_fwd", ln._add_layer_norm_fwd_op, (rows, rand(37, C), w, b, 1e-5, torch.bfloat16)),
        ("post_add_layer_norm_fwd", ln._post_add_layer_norm_fwd_op, (rows, rand(37, C), w, b, 1e-5, torch.float32)),
        ("layer_norm_bwd", ln._layer_norm_bwd_op, (rand(37, C), rows, w, b, m, r, None)),
        ("roll_partition_fwd", win._roll_partition_op, (x, ws, shift, x.dtype)),
        ("merge_roll_fwd", win._merge_roll_op, (windows, ws, shift, H, W, x, x.dtype)),
        ("norm_shift_partition_fwd", win._norm_shift_partition_fwd_op, (x, w, b, 1e-5, ws, shift, torch.bfloat16)),
        ("norm_shift_partition_bwd", win._norm_shift_partition_bwd_op,
         (torch.randn_like(windows), x, w, mean, rstd, ws, shift)),
        ("window_attention_fwd", wa._window_attention_fwd_op, (q, k, v, bias, mask, d ** -0.5)),
        ("window_attention_bwd", wa._window_attention_bwd_op, (q, k, v, out, lse, dout, bias, mask, d ** -0.5, True)),
        ("window_attention_qkv_bwd", wa._window_attention_qkv_bwd_op,
         (qkv, out, lse, dout, bias, None, d ** -0.5, True)),
        ("bias_grad", lin._bias_grad_op, (rand(37, C), rand(37, C), torch.float32)),
        ("rel_pos_table_grad", wa.rel_pos_table_grad,
         (rand(nh, n, n), wa.rel_pos_inverse(_rel_index(7).to(DEVICE), 169), torch.float32)),
        ("window_attention_table_fwd", wa._window_attention_table_fwd_op,
         (q, k, v, rand(169, nh), _rel_index(7).to(DEVICE), mask, d ** -0.5)),
        ("window_attention_qkv_table_bwd", wa._window_attention_qkv_table_bwd_op,
         (qkv, out, lse, dout, rand(169, nh), _rel_index(7).to(DEVICE), wa.rel_pos_inverse(_rel_index(7).to(DEVICE), 169),
          None, d ** -0.5, True)),
        ("window_attention_table_bwd", wa._window_attention_table_bwd_op,
         (q, k, v, out, lse, dout, rand(169, nh), _rel_index(7).to(DEVICE),
          wa.rel_pos_inverse(_rel_index(7).to(DEVICE), 169), mask, d ** -0.5, True)),
        ("window_attention_cosine_fwd", wa._window_attention_cosine_fwd_op,
         (q, k, v, rand(169, nh), _rel_index(7).to(DEVICE), mask, rand(nh).abs() + 1)),
        ("add_norm_shift_partition_fwd", win._add_norm_shift_partition_fwd_op,
         (x, rand(B, H, W, C), w, b, 1e-5, ws, shift, torch.bfloat16, rand(B))),
        ("add_norm_shift_partition_bwd", win._add_norm_shift_partition_bwd_op,
         (torch.randn_like(windows), x, w, mean, rstd, ws, shift, rand(B, H, W, C))),
        ("add_norm_shift_partition_keep_bwd", win._add_norm_shift_partition_keep_bwd_op,
         (torch.randn_like(windows), x, w, mean, rstd, ws, shift, None, rand(B), torch.bfloat16)),
        ("merge_add_norm_fwd", win._merge_add_norm_fwd_op,
         (windows, x, w, b, 1e-5, ws, shift, torch.bfloat16, rand(B))),
        ("merge_add_norm_bwd", win._merge_add_norm_bwd_op,
         (rand(B, H, W, C), x, w, mean, rstd, ws, shift, rand(B, H, W, C), rand(B), torch.float32, torch.float32)),
        ("cosine_rows_fwd", cos.cosine_rows_fwd, (q, rand(nh), torch.bfloat16)),
        ("cosine_rows_bwd", cos.cosine_rows_bwd, (q, dout, cos.cosine_rows_fwd(q, None, torch.float32)[1], rand(nh))),
    ]


def _rel_index(ws):
    from timm.models.swin_transformer import get_relative_position_index

    return get_relative_position_index(ws, ws)


SAMPLES = None


def samples():
    global SAMPLES
    if SAMPLES is None:
        torch.manual_seed(0)
        SAMPLES = {name: (op, args) for name, op, args in op_samples()}
    return SAMPLES


NAMES = ["layer_norm_fwd", "add_layer_norm_fwd", "post_add_layer_norm_fwd", "layer_norm_bwd",
         "roll_partition_fwd", "merge_roll_fwd", "norm_shift_partition_fwd", "norm_shift_partition_bwd",
         "window_attention_fwd", "window_attention_bwd", "window_attention_qkv_bwd", "bias_grad",
         "rel_pos_table_grad", "window_attention_table_fwd", "window_attention_qkv_table_bwd",
         "window_attention_table_bwd", "window_attention_cosine_fwd", "cosine_rows_fwd", "cosine_rows_bwd",
         "add_norm_shift_partition_fwd", "add_norm_shift_partition_bwd", "add_norm_shift_partition_keep_bwd",
         "merge_add_norm_fwd", "merge_add_norm_bwd"]


@pytest.mark.parametrize("name", NAMES)
def test_custom_op_passes_opcheck(name):
    op, args = samples()[name]
    assert isinstance(op, KernelOp) and op.op._qualname == f"swinbench::{name}"
    torch.library.opcheck(op.opaque, args, test_utils=UTILS)
    if op.traceable:
        # The triton_op (a GPU): AOTAutograd traces its host function; static shapes only (torch.compile
        # with symbolic ones gets the opaque op).
        torch.library.opcheck(op.op, args, test_utils=UTILS_TRACED)


def key_tiled_attention_samples():
    """The window-attention ops at N = 144 (12x12 windows), where the host functions launch the key-tiled
    kernels: (name, op, args)."""
    torch.manual_seed(1)
    bnw, nh, n, d, n_table = 4, 2, 144, 16, 529
    qkv = rand(bnw, n, 3, nh, d)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    bias, mask, table = rand(nh, n, n), rand(2, n, n), rand(n_table, nh)
    index = _rel_index(12).to(DEVICE)
    inverse = wa.rel_pos_inverse(index, n_table)
    out, lse = wa.window_attention_fwd(q, k, v, bias, mask, d ** -0.5)
    dout = rand(bnw, nh, n, d)
    return [
        ("window_attention_fwd", wa._window_attention_fwd_op, (q, k, v, bias, mask, d ** -0.5)),
        ("window_attention_bwd", wa._window_attention_bwd_op, (q, k, v, out, lse, dout, bias, mask, d ** -0.5, True)),
        ("window_attention_qkv_bwd", wa._window_attention_qkv_bwd_op,
         (qkv, out, lse, dout, bias, None, d ** -0.5, True)),
        ("window_attention_table_fwd", wa._window_attention_table_fwd_op, (q, k, v, table, index, mask, d ** -0.5)),
        ("window_attention_qkv_table_bwd", wa._window_attention_qkv_table_bwd_op,
         (qkv, out, lse, dout, table, index, inverse, mask, d ** -0.5, True)),
        ("window_attention_table_bwd", wa._window_attention_table_bwd_op,
         (q, k, v, out, lse, dout, table, index, inverse, mask, d ** -0.5, True)),
    ]


@pytest.mark.parametrize("index", range(6), ids=["fwd", "bwd", "qkv_bwd", "table_fwd", "qkv_table_bwd", "table_bwd"])
def test_key_tiled_attention_ops_pass_opcheck(index):
    """The window-attention ops at N = 144 (the key-tiled kernels): same schema, fake shapes and strides."""
    name, op, args = key_tiled_attention_samples()[index]
    assert op.op._qualname == f"swinbench::{name}"
    torch.library.opcheck(op.opaque, args, test_utils=UTILS)
    if op.traceable:
        torch.library.opcheck(op.op, args, test_utils=UTILS_TRACED)


def test_every_swinbench_op_is_sampled():
    ops = [o for m in (ln, win, wa, lin, cos) for o in vars(m).values() if isinstance(o, KernelOp)]
    assert sorted(o.op._qualname.split("::")[1] for o in ops) == sorted(NAMES)


def test_eager_calls_skip_the_dispatcher(monkeypatch):
    """Outside torch.compile the entry point runs the plain host function: the op is never called."""
    op, args = samples()["layer_norm_fwd"]

    def refuse(*a, **k):
        raise AssertionError("eager call went through the custom op")

    monkeypatch.setattr(op, "op", refuse)
    y, mean, rstd = op(*args)
    ref = torch.nn.functional.layer_norm(args[0], (args[0].shape[-1],), args[1], args[2], args[3])
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)


def test_traced_launches_pass_the_kernels_defaults():
    """While torch.compile traces, launches go through wrap_triton, which does not apply a kernel's
    default arguments itself: launch() fills them in (an argument list short of them made Inductor's
    mutation analysis assume every input written, and AOTAutograd refuse a LayerNorm weight)."""
    from workbench.kernels._common import with_kernel_defaults
    k = win._norm_partition_bwd_kernel
    given = {"PDL": True, "ROW_SUMS": True}
    filled = with_kernel_defaults(k, tuple(range(9)), given)
    assert filled == {"PDL": True, "ROW_SUMS": True, "SLOTS": 1, "PDL_EARLY": False, "KEEP": False,
                      "RES_OUT": False, "POST": False}
    assert given == {"PDL": True, "ROW_SUMS": True}  # the caller's dict is left alone
    # a default passed positionally counts as given
    import inspect
    names = list(inspect.signature(k.fn).parameters)
    n = names.index("SLOTS") + 1
    assert "SLOTS" not in with_kernel_defaults(k, tuple(range(n)), {})


def test_traced_launches_leave_autotuned_arguments_to_the_autotuner():
    import triton
    import triton.language as tl
    from workbench.kernels._common import with_kernel_defaults

    def body(X, N, BLOCK: tl.constexpr = 16, FLAG: tl.constexpr = False):
        pass
    tuned = triton.autotune([triton.Config({"BLOCK": 32})], key=["N"])(triton.jit(body))
    assert with_kernel_defaults(tuned, (None, 4), {}) == {"FLAG": False}


@pytest.mark.parametrize("module", [ln, win, wa, lin], ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_jit_functions_keep_their_own_names(module):
    """Inductor copies a traced kernel's source together with the @triton.jit functions it calls, under
    their own names (fn.__name__). A kernel module that imports one under another name (`pdl_enter as
    _pdl_enter`) compiles with Triton but not under torch.compile's Inductor (NameError in the copy)."""
    import triton
    jit_types = tuple(t for t in (getattr(triton, "JITFunction", None),
                                  getattr(getattr(triton, "runtime", None), "JITFunction", None)) if t)
    renamed = []
    for name, obj in vars(module).items():
        fn = getattr(obj, "fn", None)
        if (isinstance(obj, jit_types) or type(obj).__name__ == "InterpretedFunction") and callable(fn):
            own = getattr(fn, "__name__", name)
            if own != name and vars(module).get(own) is not obj:  # an alias beside the own name is harmless
                renamed.append(f"{name} -> {own}")
    assert not renamed, f"{module.__name__} holds @triton.jit functions only under other names: {renamed}"
