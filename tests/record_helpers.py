"""Stage records for tests: `record(...)` builds a valid record dict (what `apply` writes), to edit."""
from workbench.results.record import SCHEMA

ENV = {"device_type": "cuda", "gpu": "NVIDIA H200", "driver": "580.1", "cuda": "12.8", "torch": "2.11.0",
       "triton": "3.5.0", "timm": "1.0.29", "python": "3.12.3", "host": "gpu1", "date": "2026-01-01T00:00:00+00:00"}


def record(i, stage, extends, step_ms, *, gate="PASS", status="ok", shares=None, precision="bf16"):
    """Stage `stage` (index i) of run r1 on an H200: timed at `step_ms` per step when status is 'ok'."""
    timed = status == "ok"
    return {
        "schema": SCHEMA, "run_id": "r1", "recipe": "fmha", "stage": stage, "stage_index": i, "status": status,
        "error": None if status == "ok" else "fused_window: not available: no kernel",
        "extends": extends, "description": f"{stage} stage", "model": "swin_tiny_patch4_window7_224", "mode": "train",
        "batch": 64, "precision": precision, "device": "cuda", "seed": 0, "env": dict(ENV),
        "timing": {"samples_ms": [step_ms] * 4, "warmup": 5, "clock": "cuda-events", "median_ms": step_ms,
                   "iqr_ms": 0.5, "repeats": 4} if timed else None,
        "img_per_s": 64 / (step_ms / 1e3) if timed else None, "step_ms": step_ms if timed else None,
        "step_iqr_ms": 0.5 if timed else None, "peak_mem_bytes": 3 * 2**30 if timed else None,
        "compile_s": None, "optimizer": "torch.optim.AdamW(fused=True)",
        "gate": {"status": gate, "tolerance": {"logits_rel": 0.05, "loss_atol": 0.05, "grad_rel": 0.15},
                 "metrics": {"logits": {"max_abs": 1e-3, "rel_l2": 7e-3}, "loss": {"abs_diff": 1e-4},
                             "grads": {"head.fc.weight": {"max_abs": 1e-4, "rel_l2": 6e-3}}},
                 "reason": "logits rel L2 0.1 > 0.05" if gate == "FAIL" else None},
        "passes": [{"name": f"{stage}_pass", "params": {}, "changed": f"{stage} changed things", "details": {},
                    "available": status == "ok"}] if extends else [],
        "stage_passes": [f"{stage}_pass"] if extends else [],
        "profile": {"backend": "nsys", "trace": "t.sqlite", "category_share_pct": shares} if shares else None,
        "notes": [],
    }
