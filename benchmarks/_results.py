"""What every benchmark writes: `benchmarks/results/<name>.json` (the environment stamp, the settings and
one flat record per measurement) and `benchmarks/results/<name>.md` (the same stamp and a short
Markdown table). On a GPU they go to benchmarks/results/ by default; without one nothing is written
unless --out-dir is given (an interpreter smoke run is not a measurement), except by a benchmark that
measures the CPU itself (bench_analyze), which writes there on any machine."""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from workbench.files import atomic_write_text  # noqa: E402

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def add_out_dir_argument(parser: argparse.ArgumentParser, cpu_measures: bool = False) -> None:
    """--out-dir; `cpu_measures`: the benchmark measures the CPU, so it writes to benchmarks/results/ anywhere."""
    default = ("default benchmarks/results/, on any machine: this benchmark measures the CPU" if cpu_measures
               else "default on a GPU: benchmarks/results/; without a GPU nothing is written unless this is given")
    parser.add_argument("--out-dir", type=Path, default=None,
                        help=f"folder for <name>.json and <name>.md ({default})")


def batch_bench_parser(doc: str, check_help: str) -> argparse.ArgumentParser:
    """The parser of a benchmark over Swin-B's shapes at one batch: --check (check_help), --out-dir,
    --batch (64) and --replays (CUDA-graph replays timed per measurement); doc's first line describes it."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--check", action="store_true", help=check_help)
    add_out_dir_argument(parser)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--replays", type=int, default=20, help="graph replays timed per measurement")
    return parser


def out_dir_for(given: Path | None, on_gpu: bool) -> Path | None:
    """Where the results go: the folder given, else benchmarks/results/ on a GPU, else nowhere."""
    if given is not None:
        return given
    return RESULTS_DIR if on_gpu else None


def markdown_table(headers: list[str], rows: list[list]) -> str:
    esc = lambda v: str(v).replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(map(esc, headers)) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(map(esc, r)) + " |" for r in rows]
    return "\n".join(lines)


def stamp_line(stamp: dict, cpu_measures: bool = False) -> str:
    """'NVIDIA H200, driver 580.1, CUDA 13.0; torch 2.11, triton 3.6; swinbench abc1234; 2026-01-02' (or CPU:
    a smoke run of GPU kernels under the interpreter unless `cpu_measures`)."""
    if stamp.get("device_type") == "cuda":
        device = f"{stamp.get('gpu')}, driver {stamp.get('driver') or '?'}, CUDA {stamp.get('cuda') or '?'}"
    elif cpu_measures:
        device = f"CPU ({stamp.get('cpu')}), {os.cpu_count()} cores"
    else:
        device = f"CPU ({stamp.get('cpu')}), Triton interpreter: a smoke run, not a measurement"
    versions = ", ".join(f"{k} {stamp[k]}" for k in ("torch", "triton", "timm") if stamp.get(k))
    code = f"swinbench {stamp.get('swinbench') or '?'} (source {stamp.get('swinbench_source') or '?'})"
    return f"{device}; {versions}; {code}; {str(stamp.get('date') or '')[:10]}"


def write_results(out_dir: Path | None, name: str, *, title: str, stamp: dict, settings: dict, records: list,
                  table: str, notes: list[str] = (), cpu_measures: bool = False, **extra) -> list[Path]:
    """Write `<out_dir>/<name>.json` and `<out_dir>/<name>.md` atomically -> their paths ([] when
    out_dir is None). `cpu_measures`: the benchmark measures the CPU itself (not GPU kernels)."""
    if out_dir is None:
        return []
    payload = {"benchmark": name, "environment": stamp, "settings": settings, "records": records, **extra}
    md = [f"# {title}", "", stamp_line(stamp, cpu_measures), "", table, ""]
    md += [f"- {n}" for n in notes] + ([""] if notes else [])
    md += [f"Records: `{name}.json`. Command: `python benchmarks/bench_{name}.py`."]
    return [atomic_write_text(Path(out_dir) / f"{name}.json", json.dumps(payload, indent=1, default=str) + "\n"),
            atomic_write_text(Path(out_dir) / f"{name}.md", "\n".join(md) + "\n")]


def copy_gbps(device) -> float:
    """The device's copy bandwidth in GB/s (bytes read + written): Tensor.copy_ of 1 GiB, timed with
    triton.testing.do_bench. What the memory floors of the kernel benchmarks are computed against."""
    import torch
    import triton

    src = torch.empty(1 << 28, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=100)
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e9
