"""Result records: one flat-ish JSON object per recipe stage, written as soon as the stage finishes.

Schema `swinbench.stage/1` (keys; every speed figure comes from the GPU named in `env`, or is
labelled CPU by `env.device_type`):

    schema, run_id, recipe, stage, stage_index, status ('ok' | 'not available' | 'error'), error
    model, mode, batch, precision, device, seed
    env: environment_stamp() (gpu, driver, cuda, torch, triton, timm, python, host, date, device_type)
    timing: {samples_ms, warmup, clock, median_ms, iqr_ms, repeats} | null
    img_per_s, step_ms, step_iqr_ms, peak_mem_bytes
    compile_s: seconds of the first (compiling) steps, when the stage compiles, else null
    gate: {status: 'PASS' | 'FAIL' | 'SKIP' | 'REFERENCE', tolerance: {...}, metrics: {...}, reason}
    activation_dtypes: {part: dtype} | null   output dtype of patch_embed, layers.0.., norm, head in one forward
                       under the stage's precision (gate.activation_dtypes); null where the gate did not run
    passes: [PassResult.to_dict(), ...]   (all passes of the chain up to this stage)
    profile: {backend, trace, category_share_pct: {category: pct}, top_kernels: [...], kernel_ms_per_step,
              api_calls_per_step: {kind: calls}, kernels_per_step: [{kernel (short name), ms_per_step,
              per_step}]} | null
"""
from __future__ import annotations

import json
from pathlib import Path

from .errors import UserError
from .files import atomic_write_text

SCHEMA = "swinbench.stage/1"


def short_dtype(name: str) -> str:
    """A record's torch dtype name ('float32', 'bfloat16', ...) as reports print it ('fp32', 'bf16', ...)."""
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}.get(name, name)


def write_record(record: dict, folder: Path) -> Path:
    """Write `record` as `<folder>/<stage_index>-<stage>.json` (atomically: temp file, then rename)."""
    path = Path(folder) / f"{record['stage_index']:02d}-{record['stage']}.json"
    return atomic_write_text(path, json.dumps(record, indent=2, sort_keys=False, default=str) + "\n")


def read_records(paths) -> list[dict]:
    """Stage records from files and folders (folders: every *.json in them), sorted by stage_index.
    UserError (one line) for a missing path, unreadable JSON or a file that is not a stage record."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(q for q in p.glob("*.json") if not q.name.startswith("_"))
        elif p.is_file():
            files.append(p)
        else:
            raise UserError(f"no such record file or folder: {p}")
    if not files:
        raise UserError(f"no stage records (*.json) found in {', '.join(map(str, paths))}")
    records = []
    for f in files:
        try:
            rec = json.loads(f.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UserError(f"cannot read record {f}: {exc}") from None
        if not isinstance(rec, dict) or rec.get("schema") != SCHEMA:
            raise UserError(f"{f} is not a swinbench stage record (schema {SCHEMA!r} expected)")
        rec["_path"] = str(f)
        records.append(rec)
    return sorted(records, key=lambda r: (r.get("run_id", ""), r.get("stage_index", 0)))
