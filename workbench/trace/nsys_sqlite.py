"""Nsight Systems SQLite export -> Trace frames.

Tables read (names resolved from sqlite_master, so versioned names such as `CUPTI_ACTIVITY_KIND_KERNEL_V2`
work too):

- CUPTI_ACTIVITY_KIND_KERNEL (required): start, end, deviceId, streamId, correlationId, globalPid,
  demangledName / shortName (ids into StringIds).
- CUPTI_ACTIVITY_KIND_RUNTIME: the launching API call, joined on correlationId within the same process;
  gives launch_ns (its start) and launch_tid (its globalTid).
- NVTX_EVENTS: eventType 59 (push/pop) and 60 (start/end) are ranges, 75 (domain create) names a domainId,
  marks (34) are ignored. Text is `text` or `textId` -> StringIds.
- CUPTI_ACTIVITY_KIND_MEMCPY / _MEMSET: memops frame.
- META_DATA_EXPORT, ANALYSIS_DETAILS, TARGET_INFO_GPU: meta.

nsys globalTid packs the process: pid = (globalTid >> 24) & 0xFFFFFF, tid = globalTid & 0xFFFFFF. Frames keep
the full globalTid as `tid` / `launch_tid` (unique across processes) and the decoded `pid`.

All joins run inside SQLite; the kernel rows come back as int64 arrays (Db.int_query), the small tables
through pd.read_sql_query; no per-row Python. A NULL or a text where nsys writes an integer is a -1 (an
id) or a dropped row (a time, see workbench/trace/__init__.py), never a crash: the big queries run plain
first and again with every value checked inside SQLite (`typeof`) only when numpy finds a non-integer in
the result, so a sound export pays nothing for the checks. benchmarks/bench_analyze.py times a 1M-kernel
export.
"""
from __future__ import annotations

import glob
import lzma
import os
import re
import shutil
import sqlite3
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

from workbench.errors import UserError
from workbench.trace import (
    API_COLUMNS, KERNEL_COLUMNS, MEMOP_COLUMNS, RANGE_COLUMNS, TIME_MISSING, TIME_NOT_A_NUMBER, TIME_OK, Trace,
    copy_capped, drop_bad_times, empty_frame, finish_frame, kernel_span, nesting_depth,
)

# ENUM_NSYS_EVENT_TYPE ids; read from the file when it has the enum table.
NVTX_PUSH_POP = 59
NVTX_START_END = 60
NVTX_DOMAIN_CREATE = 75
_EVENT_TYPE_NAMES = {"NvtxPushPopRange": "push_pop", "NvtxStartEndRange": "start_end", "NvtxDomainCreate": "domain"}


def pid_of(global_id: np.ndarray) -> np.ndarray:
    """Process id packed in an nsys globalTid / globalPid (-1 stays -1)."""
    g = np.asarray(global_id, dtype="int64")
    return np.where(g < 0, -1, (g >> 24) & 0xFFFFFF)


class _Db:
    """A read-only connection plus the table/column lookups the parser needs."""

    def __init__(self, path: Path):
        self.con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        rows = self.con.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'view')").fetchall()
        self.tables = {r[0] for r in rows}

    def table(self, base: str) -> str | None:
        """`base` or its highest `_V<n>` version, or None."""
        if base in self.tables:
            return base
        versions = [(int(m.group(1)), t) for t in self.tables if (m := re.fullmatch(re.escape(base) + r"_V(\d+)", t))]
        return max(versions)[1] if versions else None

    def columns(self, table: str) -> set[str]:
        return {r[1] for r in self.con.execute(f'PRAGMA table_info("{table}")')}

    def query(self, sql: str) -> pd.DataFrame:
        return pd.read_sql_query(sql, self.con)

    def int_query(self, build, columns: list[str]) -> pd.DataFrame:
        """The rows of `build(careful)` (SQL text) straight into int64 arrays, plus a `time_code` column.
        First `build(False)`, the plain query of `columns`; its rows get time_code TIME_OK. When a value in
        its result is not an integer (numpy then infers another dtype), `build(True)`: the same columns,
        each an integer by construction (_int_sql, _time_sql), then the time_code (_time_code_sql).

        For the million-row kernel query this is ~3x faster than pd.read_sql_query, which infers a dtype
        per column from Python objects.
        """
        rows = self.con.execute(build(False)).fetchall()
        try:
            arr = np.array(rows) if rows else np.zeros((0, len(columns)), dtype="int64")
        except (ValueError, TypeError, OverflowError, UnicodeDecodeError):   # a blob numpy cannot decode
            arr = None
        if arr is not None and arr.dtype == np.int64:
            df = pd.DataFrame(arr.reshape(len(rows), len(columns)), columns=columns)
            df["time_code"] = TIME_OK
            return df
        rows = self.con.execute(build(True)).fetchall()
        arr = np.array(rows, dtype="int64").reshape(len(rows), len(columns) + 1)
        return pd.DataFrame(arr, columns=columns + ["time_code"])


def _col(alias: str, name: str, have: set[str], as_name: str | None = None) -> str:
    """`alias.name AS as_name`, or `NULL AS as_name` where the column is missing (optional columns)."""
    as_name = as_name or name
    return f"{alias}.{name} AS {as_name}" if name in have else f"NULL AS {as_name}"


def _int_sql(expr: str, careful: bool = True) -> str:
    """careful: `expr` where it holds an integer, else -1 (NULL, text, a real, a blob). Plain: NULL -> -1."""
    return f"CASE WHEN typeof({expr}) = 'integer' THEN {expr} ELSE -1 END" if careful else f"COALESCE({expr}, -1)"


def _int_col(alias: str, name: str, have: set[str], careful: bool = True) -> str:
    """_int_sql of `alias.name`, or -1 where the column is missing."""
    return _int_sql(f"{alias}.{name}", careful) if name in have else "-1"


_NUMERIC = "IN ('integer', 'real')"


def _start_end(alias: str, have: set[str]) -> tuple[str, str]:
    return tuple(f"{alias}.{c}" if c in have else "NULL" for c in ("start", "end"))


def _time_sql(alias: str, have: set[str], careful: bool = True) -> list[str]:
    """start and end of `alias`: careful, a real cast to integer ns (CAST saturates, so a huge one comes
    out absurd) and anything else 0, to be classified by _time_code_sql; plain, the raw columns."""
    s, e = _start_end(alias, have)
    return [f"CASE WHEN typeof({x}) {_NUMERIC} THEN CAST({x} AS INTEGER) ELSE 0 END" for x in (s, e)] if careful else [s, e]


def _time_code_sql(alias: str, have: set[str]) -> str:
    """time_code of `alias`'s start/end, classified inside SQLite for drop_bad_times: NULL (or no such
    column) -> TIME_MISSING, text or a blob -> TIME_NOT_A_NUMBER. The numeric checks follow in numpy."""
    s, e = _start_end(alias, have)
    return (f"CASE WHEN {s} IS NULL OR {e} IS NULL THEN {TIME_MISSING} "
            f"WHEN typeof({s}) NOT {_NUMERIC} OR typeof({e}) NOT {_NUMERIC} THEN {TIME_NOT_A_NUMBER} ELSE {TIME_OK} END")


def _string_lookup(db: _Db) -> pd.Series:
    """StringIds as id -> text (the first row of a duplicated id; a NULL text stays unresolved)."""
    s = db.query("SELECT id, value FROM StringIds")
    ids = pd.to_numeric(s["id"], errors="coerce")
    s = s[ids.notna()].assign(id=ids[ids.notna()].astype("int64")).drop_duplicates("id")
    return pd.Series(s["value"].to_numpy(dtype=object), index=s["id"].to_numpy())


def _names(lookup: pd.Series, ids, clean=None) -> tuple[np.ndarray, int]:
    """(name of each string id, how many rows had none): an id StringIds lacks reads `<string id N>`, a NULL
    one (-1) `<no name>`. Resolves (and `clean`s) each distinct id once."""
    which, uniques = pd.factorize(np.asarray(ids, dtype="int64"), sort=False)
    found = lookup.reindex(uniques).to_numpy(dtype=object)
    resolved = np.array([isinstance(v, str) for v in found], dtype=bool)
    names = np.array([(clean(v) if clean else v) if ok else ("<no name>" if i < 0 else f"<string id {i}>")
                      for i, v, ok in zip(uniques, found, resolved)], dtype=object)
    return names[which], int((~resolved[which]).sum())


def _read_kernels(db: _Db, notes: list[str], warnings: list[str]) -> pd.DataFrame:
    """The kernels frame; rows with broken times dropped (drop_bad_times). UserError when the kernel table,
    its time or name columns, or StringIds are missing."""
    ktab = db.table("CUPTI_ACTIVITY_KIND_KERNEL")
    if ktab is None:
        raise UserError(
            "no kernel table (CUPTI_ACTIVITY_KIND_KERNEL) in this nsys export; capture with `nsys profile -t cuda`"
        )
    kc = db.columns(ktab)
    missing = [c for c in ("start", "end") if c not in kc]
    if missing or not ({"demangledName", "shortName"} & kc):
        need = missing + ([] if {"demangledName", "shortName"} & kc else ["demangledName/shortName"])
        raise UserError(f"kernel table {ktab} lacks required column(s): {', '.join(need)}")
    if "StringIds" not in db.tables:
        raise UserError("no StringIds table in this nsys export: kernel names cannot be resolved "
                        "(export it again with `nsys export --type sqlite`)")
    name_col = "demangledName" if "demangledName" in kc else "shortName"
    short_col = "shortName" if "shortName" in kc else "demangledName"
    columns = ["row_id", "start_ns", "end_ns", "device_id", "stream_id", "correlation_id", "global_pid", "name_id",
               "short_id", "launch_ns", "launch_tid"]
    rtab = db.table("CUPTI_ACTIVITY_KIND_RUNTIME")
    rc = db.columns(rtab) if rtab else set()
    joined = bool(rtab and {"correlationId", "start", "globalTid"} <= rc and "correlationId" in kc)
    join = ""
    if joined:
        # correlationId is unique per process, so match the process as well where the kernel row has one.
        same_process = "(k.globalPid IS NULL OR (r.globalTid >> 24) = (k.globalPid >> 24))" if "globalPid" in kc else "1"
        join = f'LEFT JOIN "{rtab}" r ON r.correlationId = k.correlationId AND {same_process}'
    else:
        notes.append("no CUDA runtime table: kernels cannot be attributed to NVTX ranges")

    def sql(careful: bool) -> str:
        select = [
            "k.rowid", *_time_sql("k", kc, careful),
            *(_int_col("k", c, kc, careful) for c in ("deviceId", "streamId", "correlationId", "globalPid", name_col, short_col)),
            *((_int_sql("r.start", careful), _int_sql("r.globalTid", careful)) if joined else ("-1", "-1")),
        ] + ([_time_code_sql("k", kc)] if careful else [])
        return f'SELECT {", ".join(select)} FROM "{ktab}" k {join}'

    df = db.int_query(sql, columns)
    if df["row_id"].duplicated().any():  # several runtime rows for one correlationId: keep the first
        df = df.drop_duplicates("row_id")
    df = drop_bad_times(df, "kernel rows", warnings)
    df = df.sort_values(["start_ns", "row_id"], kind="stable")
    df["duration_ns"] = df["end_ns"] - df["start_ns"]
    lookup = _string_lookup(db)
    df["name"], unnamed = _names(lookup, df["name_id"])
    df["short_name"], _ = _names(lookup, df["short_id"])
    if unnamed:
        warnings.append(f"{unnamed:,} of {len(df):,} kernel rows name a string id that StringIds lacks: "
                        "shown as <string id N>")
    gpid = df["global_pid"].to_numpy("int64")
    df["pid"] = np.where(gpid >= 0, pid_of(gpid), pid_of(df["launch_tid"].to_numpy("int64")))
    unlaunched = int((df["launch_ns"] < 0).sum())
    if unlaunched and join:
        notes.append(f"{unlaunched} of {len(df)} kernels have no matching runtime launch (not attributed to ranges)")
    return finish_frame(df, KERNEL_COLUMNS)


def _event_type_ids(db: _Db) -> dict[str, int]:
    ids = {"push_pop": NVTX_PUSH_POP, "start_end": NVTX_START_END, "domain": NVTX_DOMAIN_CREATE}
    if "ENUM_NSYS_EVENT_TYPE" in db.tables:
        enum = db.query("SELECT id, name FROM ENUM_NSYS_EVENT_TYPE")
        for _, row in enum[enum["name"].isin(list(_EVENT_TYPE_NAMES))].iterrows():  # at most 3 rows
            ids[_EVENT_TYPE_NAMES[row["name"]]] = int(row["id"])
    return ids


def _read_ranges(db: _Db, notes: list[str], warnings: list[str]) -> pd.DataFrame:
    ntab = db.table("NVTX_EVENTS")
    if ntab is None:
        notes.append("no NVTX_EVENTS table: no ranges")
        return empty_frame(RANGE_COLUMNS)
    nc = db.columns(ntab)
    ids = _event_type_ids(db)
    text = "e.text" if "text" in nc else "NULL"
    join = ""
    if "textId" in nc and "StringIds" in db.tables:
        text = f"COALESCE({text}, s.value)"
        join = "LEFT JOIN StringIds s ON s.id = e.textId"
    (start, end), code = _time_sql("e", nc), _time_code_sql("e", nc)
    # a push with no pop (the capture stopped inside the range) is normal; any other missing time is not
    open_ended = f"CASE WHEN {code} = {TIME_MISSING} AND typeof(e.start) IN ('integer', 'real') THEN 1 ELSE 0 END" \
        if "start" in nc and "end" in nc else "0"
    sql = (
        f'SELECT {start} AS start_ns, {end} AS end_ns, {code} AS time_code, {open_ended} AS open_ended, '
        f'e.eventType AS event_type, {text} AS name, {_col("e", "globalTid", nc, "tid")}, '
        f'{_col("e", "domainId", nc, "domain_id")} '
        f'FROM "{ntab}" e {join} WHERE e.eventType IN ({ids["push_pop"]}, {ids["start_end"]}, {ids["domain"]})'
    )
    ev = db.query(sql)
    ev["tid"] = pd.to_numeric(ev["tid"], errors="coerce").fillna(-1).astype("int64")
    ev["pid"] = pid_of(ev["tid"].to_numpy())
    ev["domain_id"] = pd.to_numeric(ev["domain_id"], errors="coerce").fillna(0).astype("int64")
    domains = ev[ev["event_type"] == ids["domain"]]
    ranges = ev[ev["event_type"] != ids["domain"]].copy()
    open_ended = int(ranges["open_ended"].sum())
    if open_ended:
        notes.append(f"{open_ended} NVTX ranges never ended (dropped)")
        ranges = ranges[ranges["open_ended"] == 0]
    ranges = drop_bad_times(ranges, "NVTX range rows", warnings)
    # A domainId is named by its NvtxDomainCreate event in the same process; 0 is the default domain.
    domain_names = domains.drop_duplicates(["pid", "domain_id"]).set_index(["pid", "domain_id"])["name"]
    key = pd.MultiIndex.from_arrays([ranges["pid"].to_numpy(), ranges["domain_id"].to_numpy()])
    ranges["domain"] = domain_names.reindex(key).fillna("").to_numpy(dtype=object)
    # a name that is no text (a BLOB in a damaged export) reads as the kernels' unnamed ones do
    ranges["name"] = [v if isinstance(v, str) else "" if v is None or v != v else "<no name>"
                      for v in ranges["name"].to_numpy(dtype=object)]
    ranges = ranges.sort_values(["start_ns", "end_ns"], ascending=[True, False], kind="stable").reset_index(drop=True)
    ranges["end_ns"] = ranges["end_ns"].astype("int64")
    ranges["range_id"] = np.arange(len(ranges), dtype="int64")
    ranges["depth"] = nesting_depth(
        ranges["start_ns"].to_numpy("int64"), ranges["end_ns"].to_numpy("int64"), ranges["tid"].to_numpy("int64")
    )
    return finish_frame(ranges, RANGE_COLUMNS)


_API_VERSION = re.compile(r"_v\d+$")


def _read_api(db: _Db, warnings: list[str]) -> pd.DataFrame:
    """Every CUDA runtime / driver call nsys traced (CUPTI_ACTIVITY_KIND_RUNTIME), named without the
    `_v3020`-style version suffix; rows with broken times dropped."""
    tab = db.table("CUPTI_ACTIVITY_KIND_RUNTIME")
    c = db.columns(tab) if tab else set()
    if not tab or not {"start", "end", "nameId"} <= c:
        return empty_frame(API_COLUMNS)
    df = db.int_query(
        lambda careful: f'SELECT {", ".join(_time_sql("r", c, careful))}, '
                        f'{", ".join(_int_col("r", col, c, careful) for col in ("nameId", "globalTid", "correlationId"))}'
                        f'{", " + _time_code_sql("r", c) if careful else ""} FROM "{tab}" r',
        ["start_ns", "end_ns", "name_id", "tid", "correlation_id"])
    df = drop_bad_times(df, "CUDA API rows", warnings)
    df = df.sort_values("start_ns", kind="stable")
    df["duration_ns"] = df["end_ns"] - df["start_ns"]
    # a few dozen distinct calls: the version suffix is stripped once per name
    df["name"], unnamed = _names(_string_lookup(db), df["name_id"], clean=lambda n: _API_VERSION.sub("", n))
    if unnamed:
        warnings.append(f"{unnamed:,} of {len(df):,} CUDA API rows name a string id that StringIds lacks: "
                        "shown as <string id N>")
    df["pid"] = pid_of(df["tid"].to_numpy("int64"))
    return finish_frame(df, API_COLUMNS)


def _read_memops(db: _Db, warnings: list[str]) -> pd.DataFrame:
    frames = []
    for kind, base in (("memcpy", "CUPTI_ACTIVITY_KIND_MEMCPY"), ("memset", "CUPTI_ACTIVITY_KIND_MEMSET")):
        tab = db.table(base)
        if tab is None:
            continue
        c = db.columns(tab)
        if not {"start", "end"} <= c:
            continue
        (start, end), code = _time_sql("m", c), _time_code_sql("m", c)
        df = db.query(
            f'SELECT {start} AS start_ns, {end} AS end_ns, {code} AS time_code, {_col("m", "bytes", c)}, '
            f'{_col("m", "deviceId", c, "device_id")}, {_col("m", "streamId", c, "stream_id")}, '
            f'{_col("m", "correlationId", c, "correlation_id")} FROM "{tab}" m'
        )
        df["kind"] = kind
        frames.append(df)
    if not frames:
        return empty_frame(MEMOP_COLUMNS)
    df = drop_bad_times(pd.concat(frames, ignore_index=True), "memcpy/memset rows", warnings)
    df = df.sort_values("start_ns", kind="stable")
    df["duration_ns"] = df["end_ns"] - df["start_ns"]
    return finish_frame(df, MEMOP_COLUMNS)


def _read_meta(db: _Db) -> dict:
    meta: dict = {}
    if "META_DATA_EXPORT" in db.tables:
        kv = dict(db.con.execute("SELECT name, value FROM META_DATA_EXPORT").fetchall())
        text = {k: v if isinstance(v, str) else str(v) if isinstance(v, (int, float)) else None for k, v in kv.items()}
        meta["export_version"] = text.get("EXPORT_PRODUCT_VERSION")
        meta["schema_version"] = text.get("EXPORT_SCHEMA_VERSION")
    if "ANALYSIS_DETAILS" in db.tables and {"startTime", "stopTime"} <= db.columns("ANALYSIS_DETAILS"):
        row = db.con.execute("SELECT MIN(startTime), MAX(stopTime) FROM ANALYSIS_DETAILS").fetchone()
        meta["capture_start_ns"], meta["capture_end_ns"] = row
    if "TARGET_INFO_GPU" in db.tables and "name" in db.columns("TARGET_INFO_GPU"):
        meta["gpus"] = [r[0] for r in db.con.execute("SELECT name FROM TARGET_INFO_GPU") if isinstance(r[0], str)]
    return meta


def load_sqlite(path: Path, display_path: Path | None = None) -> Trace:
    """Parse an nsys SQLite export. `display_path` is what meta['path'] and messages name (the .xz, say)."""
    shown = display_path or path
    notes: list[str] = []
    warnings: list[str] = []
    try:
        db = _Db(path)
        try:
            kernels = _read_kernels(db, notes, warnings)
            if kernels.empty and warnings:
                raise UserError(f"no GPU kernel with valid times in {shown}: {'; '.join(warnings)}")
            if kernels.empty:
                raise UserError(f"empty trace: no GPU kernels in {shown}")
            ranges = _read_ranges(db, notes, warnings)
            memops = _read_memops(db, warnings)
            api = _read_api(db, warnings)
            meta = _read_meta(db)
        finally:
            db.con.close()
    except (sqlite3.DatabaseError, pd.errors.DatabaseError) as e:  # not a database, truncated, malformed
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if first.startswith("Execution failed on sql"):     # pandas quotes the whole query: keep the cause
            first = first.rsplit(": ", 1)[-1]
        raise UserError(f"cannot read {shown} as an nsys SQLite export: {first[:200]}") from None
    except UnicodeDecodeError:    # text that is no UTF-8 where the export keeps names
        raise UserError(f"cannot read {shown} as an nsys SQLite export: text in it is not UTF-8 (a damaged "
                        "file?)") from None
    span_start, span_end = kernel_span(kernels)
    meta.setdefault("export_version", None)
    meta.setdefault("schema_version", None)
    meta.update(source="nsys", path=str(shown), span_start_ns=span_start, span_end_ns=span_end, notes=notes,
                warnings=warnings)
    return Trace(kernels=kernels, ranges=ranges, meta=meta, memops=memops, api=api)


def load_sqlite_xz(path: Path) -> Trace:
    """Decompress to a temporary file (SQLite needs a real file), parse it, delete it. The stream stops at
    the decompression cap (copy_capped): UserError beyond it."""
    fd, tmp = tempfile.mkstemp(suffix=".sqlite", prefix="swinbench-")
    try:
        try:
            with lzma.open(path) as src, os.fdopen(fd, "wb") as dst:
                copy_capped(src, dst, path)
        except (lzma.LZMAError, EOFError, OSError) as e:
            raise UserError(f"cannot decompress {path}: {e}") from None
        return load_sqlite(Path(tmp), display_path=path)
    finally:
        os.unlink(tmp)


# Where Nsight Systems installs nsys, newest version folder first.
NSYS_FOLDERS = (
    "/opt/nvidia/nsight-systems/*/bin",
    "/usr/local/cuda/bin",
    "/opt/nvidia/nsight-compute/*/host/target-linux-x64",
)


def find_nsys(explicit: str | None = None) -> str | None:
    """nsys from an explicit path (`--nsys`), then $SWINBENCH_NSYS, then PATH, then the usual install
    folders (NSYS_FOLDERS); None when there is none. An explicit path or $SWINBENCH_NSYS that is not an
    executable file is a UserError. Lives here, not in `capture`, so that reading a trace imports no torch."""
    for candidate, where in ((explicit, "--nsys"), (os.environ.get("SWINBENCH_NSYS"), "$SWINBENCH_NSYS")):
        if candidate:
            if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
                return str(candidate)
            raise UserError(f"nsys not found at {candidate} ({where})")
    on_path = shutil.which("nsys")
    if on_path:
        return on_path
    for pattern in NSYS_FOLDERS:
        for folder in sorted(glob.glob(pattern), reverse=True):  # newest version folder first
            path = os.path.join(folder, "nsys")
            if os.path.isfile(path) and os.access(path, os.X_OK):
                return path
    return None


def load_nsys_rep(path: Path) -> Trace:
    """`nsys export --type sqlite` into a temporary folder, then parse."""
    nsys = find_nsys()
    if nsys is None:
        raise UserError(
            f"nsys not found (set SWINBENCH_NSYS or add it to PATH) to read {path.name}; "
            "or export it elsewhere with `nsys export --type sqlite` and pass the .sqlite"
        )
    with tempfile.TemporaryDirectory(prefix="swinbench-") as tmp:
        out = Path(tmp) / (path.stem + ".sqlite")
        cmd = [nsys, "export", "--type", "sqlite", "--force-overwrite", "true", "--output", str(out), str(path)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise UserError(f"nsys export failed for {path}: {e}") from None
        if proc.returncode != 0 or not out.exists():
            last = (proc.stderr or proc.stdout or "").strip().splitlines()
            raise UserError(f"nsys export failed for {path}: {last[-1] if last else f'exit {proc.returncode}'}")
        return load_sqlite(out, display_path=path)
