"""Every benchmark imports and answers --help; three of them run a CPU smoke pass under the Triton
interpreter and write their results files (JSON + Markdown, stamped) where they are told."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(BENCH.glob("bench_*.py"))


def load(path: Path):
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"swinbench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_one_benchmark_per_kernel_family():
    assert {p.stem for p in SCRIPTS} == {"bench_layer_norm", "bench_window", "bench_window_attention",
                                         "bench_linear", "bench_analyze", "bench_quant", "bench_rel_pos_grad",
                                         "bench_adamw", "bench_mlp", "bench_qkv_attention"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_help(script, capsys):
    module = load(script)
    with pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--out-dir" in out


def test_no_benchmark_sets_a_kernel_module_global():
    """Benchmarks measure the kernels as shipped: no experiment switches flipped from outside."""
    for script in SCRIPTS:
        text = script.read_text()
        assert "_ops." not in text and "_common." not in text, script.name
        assert "SWINBENCH_" not in text, script.name


def check_results(folder: Path, name: str):
    data = json.loads((folder / f"{name}.json").read_text())
    assert data["benchmark"] == name and data["environment"]["device_type"] == "cpu" and data["records"]
    md = (folder / f"{name}.md").read_text()
    assert md.startswith("# ") and "CPU" in md and "| ---" not in md and "|---|" in md


def test_linear_smoke_on_the_cpu(tmp_path):
    module = load(BENCH / "bench_linear.py")
    assert module.main(["--check", "--out-dir", str(tmp_path)]) == 0
    check_results(tmp_path, "linear")


def test_rel_pos_grad_smoke_on_the_cpu(tmp_path):
    module = load(BENCH / "bench_rel_pos_grad.py")
    assert module.main(["--check", "--out-dir", str(tmp_path)]) == 0
    check_results(tmp_path, "rel_pos_grad")


def test_adamw_smoke_on_the_cpu(tmp_path):
    module = load(BENCH / "bench_adamw.py")
    assert module.main(["--check", "--out-dir", str(tmp_path)]) == 0
    check_results(tmp_path, "adamw")


def test_quant_smoke_on_the_cpu(tmp_path):
    module = load(BENCH / "bench_quant.py")
    assert module.main(["--check", "--out-dir", str(tmp_path)]) == 0
    check_results(tmp_path, "quant")


def test_mlp_smoke_on_the_cpu(tmp_path):
    module = load(BENCH / "bench_mlp.py")
    assert module.main(["--check", "--out-dir", str(tmp_path)]) == 0
    check_results(tmp_path, "mlp")


def test_qkv_attention_smoke_on_the_cpu(tmp_path):
    module = load(BENCH / "bench_qkv_attention.py")
    assert module.main(["--check", "--out-dir", str(tmp_path)]) == 0
    check_results(tmp_path, "qkv_attention")


def test_analyze_help_says_it_writes_its_results_without_a_gpu(capsys):
    # bench_analyze measures the CPU: it writes benchmarks/results/ on any machine, unlike the kernel benchmarks
    with pytest.raises(SystemExit):
        load(BENCH / "bench_analyze.py").main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "on any machine" in out and "nothing is written" not in out
    with pytest.raises(SystemExit):
        load(BENCH / "bench_quant.py").main(["--help"])
    assert "nothing is written" in " ".join(capsys.readouterr().out.split())


def test_analyze_smoke(tmp_path):
    module = load(BENCH / "bench_analyze.py")
    assert module.main(["--kernels", "2000", "--out-dir", str(tmp_path)]) == 0
    check_results(tmp_path, "analyze")


def test_cosine_attention_smoke_on_the_cpu(tmp_path):
    """SwinV2's inference attention: the in-kernel cosine form checked bit for bit against the two-launch
    form and against eager in fp32, one stage."""
    module = load(BENCH / "bench_window_attention.py")
    assert module.main(["--cosine", "--check", "--stages", "4", "--out-dir", str(tmp_path)]) == 0
    check_results(tmp_path, "window_attention_cosine")
    data = json.loads((tmp_path / "window_attention_cosine.json").read_text())
    assert all(c["bit_exact_vs_2pass"] for c in data["check"])
    assert {r["method"] for r in data["records"]} == {"eager_v2", "sdpa_v2", "fused_2pass", "fused_cosine"}


def test_scaling_script_runs_with_python3_alone_and_a_rerun_skips_a_finished_profile(tmp_path):
    """scaling.sh on a machine whose PATH has python3 but no `python` (the commands echoed, 2 GPUs said):
    every N up to the GPUs, and a profile whose ranks.csv is there is not captured again."""
    import os
    import shutil
    import subprocess

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text("#!/bin/sh\necho 2\n")
    (bin_dir / "python3").chmod(0o755)
    for tool in ("bash", "env"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    done = tmp_path / "out" / "m-n1-profile"
    done.mkdir(parents=True)
    (done / "ranks.csv").write_text("rank\n0\n")
    env = {"PATH": str(bin_dir), "SWINBENCH": "echo", "NPROCS": "1 2 4", "MODELS": "m", "OUT": str(tmp_path / "out")}
    run = subprocess.run(["bash", str(BENCH / "scaling.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert [ln.split()[0] for ln in lines[:-1]] == ["apply", "kept", "apply", "profile", "skip"]
    assert "--nproc 2" in lines[2] and "--resume" in lines[2] and "skip N=4: 2 GPU(s) here" in lines[4]


def test_scaling_script_goes_on_past_a_failing_command_and_names_it(tmp_path):
    """One apply that fails (a stage that errors) does not stop the other N and models; the script names
    it at the end and exits 1."""
    import os
    import shutil
    import subprocess

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text("#!/bin/sh\necho 2\n")
    (bin_dir / "fake-swinbench").write_text('#!/bin/sh\necho "$@"\ncase "$*" in apply*"--nproc 1"*) exit 2;; esac\n')
    for name in ("python3", "fake-swinbench"):
        (bin_dir / name).chmod(0o755)
    for tool in ("bash", "env"):
        os.symlink(shutil.which(tool), bin_dir / tool)
    env = {"PATH": str(bin_dir), "SWINBENCH": "fake-swinbench", "NPROCS": "1 2", "MODELS": "m",
           "OUT": str(tmp_path / "out")}
    run = subprocess.run(["bash", str(BENCH / "scaling.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 1, run.stderr
    firsts = [ln.split()[0] for ln in run.stdout.splitlines()]
    assert firsts[:4] == ["apply", "profile", "apply", "profile"]
    assert "failed: apply m N=1 (exit 2)" in run.stdout and "N=2" not in run.stdout.split("failed:")[1]


def test_window_attention_grid_orders_swap_the_key_tiled_autotuners_and_put_them_back():
    """--window 12 on a GPU times `fused` with each grid order autotuned alone: inside the context the three
    key-tiled kernels are autotuners over that order's configs only; after it, the module's own again."""
    from workbench.kernels import window_attention as wa

    module = load(BENCH / "bench_window_attention.py")
    before = (wa._fwd_tiled, wa._bwd_dq, wa._bwd_dkv)
    for fastest in (False, True):
        with module.grid_order(fastest)():
            for kernel in (wa._fwd_tiled, wa._bwd_dq, wa._bwd_dkv):
                assert kernel.configs and all(bool(c.kwargs.get("TILE_FASTEST")) == fastest for c in kernel.configs)
        assert (wa._fwd_tiled, wa._bwd_dq, wa._bwd_dkv) == before
    assert set(module.GRID_ORDERS) <= set(module.methods("cuda", tiled=True))
    assert not set(module.GRID_ORDERS) & set(module.methods("cuda", tiled=False))
