"""nsys SQLite parser on the real Swin-T fixtures; expected numbers come from SQL run here, not the parser."""
from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pandas as pd
import pytest

from workbench.trace import KERNEL_COLUMNS, RANGE_COLUMNS, load_trace

DATA = Path(__file__).parent / "data"
BLOCKS = {f"stage{s}.block{b}" for s, n in enumerate([2, 2, 6, 2]) for b in range(n)}


@pytest.fixture(scope="session")
def fixture_sqlite(unxz):
    """Both fixtures decompressed once per session: {'bf16': Path, 'fp32': Path}."""
    return {p: unxz(DATA / f"swin_tiny_train_{p}.sqlite.xz") for p in ("bf16", "fp32")}


@pytest.fixture(scope="session")
def traces(fixture_sqlite):
    return {p: load_trace(path) for p, path in fixture_sqlite.items()}


def sql(path, query):
    with sqlite3.connect(path) as con:
        return con.execute(query).fetchall()


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_kernel_count_and_total_match_sql(traces, fixture_sqlite, precision):
    k = traces[precision].kernels
    [(count, total)] = sql(fixture_sqlite[precision], "SELECT COUNT(*), SUM(end - start) FROM CUPTI_ACTIVITY_KIND_KERNEL")
    assert len(k) == count
    assert int(k["duration_ns"].sum()) == total
    assert list(k.columns) == KERNEL_COLUMNS
    assert (k["duration_ns"] == k["end_ns"] - k["start_ns"]).all()


def test_per_name_sums_match_sql(traces, fixture_sqlite):
    rows = sql(
        fixture_sqlite["bf16"],
        "SELECT s.value, COUNT(*), SUM(k.end - k.start) FROM CUPTI_ACTIVITY_KIND_KERNEL k "
        "JOIN StringIds s ON s.id = k.demangledName GROUP BY s.value",
    )
    expected = pd.DataFrame(rows, columns=["name", "n", "ns"]).set_index("name").sort_index()
    got = traces["bf16"].kernels.groupby("name")["duration_ns"].agg(n="size", ns="sum").sort_index()
    assert got.index.tolist() == expected.index.tolist()
    assert got["n"].tolist() == expected["n"].tolist()
    assert got["ns"].tolist() == expected["ns"].tolist()


def test_launch_info_from_runtime_join(traces, fixture_sqlite):
    k = traces["bf16"].kernels
    assert (k["launch_ns"] >= 0).all()  # every kernel of the fixture has its runtime call
    assert (k["launch_ns"] <= k["start_ns"]).all()  # launched before it ran
    assert set(k["pid"]) == {935}  # python3 in PROCESSES
    threads = sql(fixture_sqlite["bf16"], "SELECT DISTINCT globalTid FROM CUPTI_ACTIVITY_KIND_RUNTIME")
    assert set(k["launch_tid"]) <= {t for (t,) in threads}
    assert k["launch_tid"].nunique() == 2  # the main thread and autograd's


def test_ranges_names_domains_depth(traces):
    r = traces["bf16"].ranges
    assert list(r.columns) == RANGE_COLUMNS
    sw = r[r["domain"] == "swinbench"]
    assert len(sw) == 4 * (1 + 3 + len(BLOCKS))
    assert set(sw["name"]) == {f"step{i}" for i in range(4)} | {"forward", "backward", "optimizer"} | BLOCKS
    depth = sw.groupby("name")["depth"].unique()
    assert all(list(depth[f"step{i}"]) == [0] for i in range(4))
    assert all(list(depth[n]) == [1] for n in ("forward", "backward", "optimizer"))
    assert all(list(depth[b]) == [2] for b in BLOCKS)
    assert set(r["domain"]) == {"swinbench", "CCCL"}  # cub's own NVTX ranges on the autograd thread
    assert (r["end_ns"] >= r["start_ns"]).all()


def test_meta(traces, fixture_sqlite):
    m = traces["bf16"].meta
    assert m["source"] == "nsys" and m["export_version"] == "2025.3.2.0" and m["schema_version"] == "3.20.3"
    k = traces["bf16"].kernels
    assert (m["span_start_ns"], m["span_end_ns"]) == (k["start_ns"].min(), k["end_ns"].max())
    assert m["gpus"] == ["NVIDIA H200"]


def test_memops(traces, fixture_sqlite):
    mem = traces["bf16"].memops
    [(n_cpy, ns_cpy)] = sql(fixture_sqlite["bf16"], "SELECT COUNT(*), SUM(end - start) FROM CUPTI_ACTIVITY_KIND_MEMCPY")
    [(n_set, ns_set)] = sql(fixture_sqlite["bf16"], "SELECT COUNT(*), SUM(end - start) FROM CUPTI_ACTIVITY_KIND_MEMSET")
    assert (mem["kind"] == "memcpy").sum() == n_cpy and (mem["kind"] == "memset").sum() == n_set
    assert int(mem["duration_ns"].sum()) == ns_cpy + ns_set


def test_xz_equals_sqlite(traces):
    from_xz = load_trace(DATA / "swin_tiny_train_bf16.sqlite.xz")
    pd.testing.assert_frame_equal(from_xz.kernels, traces["bf16"].kernels)
    pd.testing.assert_frame_equal(from_xz.ranges, traces["bf16"].ranges)
    assert from_xz.meta["path"].endswith(".sqlite.xz")


def test_versioned_table_names(fixture_sqlite, traces, tmp_path):
    path = tmp_path / "versioned.sqlite"
    shutil.copy(fixture_sqlite["fp32"], path)
    with sqlite3.connect(path) as con:
        con.execute("ALTER TABLE CUPTI_ACTIVITY_KIND_KERNEL RENAME TO CUPTI_ACTIVITY_KIND_KERNEL_V3")
        con.execute("ALTER TABLE CUPTI_ACTIVITY_KIND_RUNTIME RENAME TO CUPTI_ACTIVITY_KIND_RUNTIME_V2")
    t = load_trace(path)
    pd.testing.assert_frame_equal(t.kernels, traces["fp32"].kernels)


def test_missing_optional_columns_are_filled(tmp_path):
    """An old/trimmed export: kernels with start/end/shortName only, NVTX text inline, no runtime table."""
    path = tmp_path / "minimal.sqlite"
    with sqlite3.connect(path) as con:
        con.execute("CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT)")
        con.execute("INSERT INTO StringIds VALUES (1, 'gemm_kernel'), (2, 'softmax_kernel')")
        con.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER, end INTEGER, shortName INTEGER)")
        con.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?, ?, ?)", [(10, 30, 1), (40, 45, 2), (50, 70, 1)])
        con.execute("CREATE TABLE NVTX_EVENTS (start INTEGER, end INTEGER, eventType INTEGER, text TEXT, globalTid INTEGER)")
        con.executemany("INSERT INTO NVTX_EVENTS VALUES (?, ?, ?, ?, ?)",
                        [(5, 80, 59, 'outer', 7), (6, 20, 59, 'inner', 7), (8, None, 34, 'a mark', 7)])
    t = load_trace(path)
    assert t.kernels["name"].tolist() == ["gemm_kernel", "softmax_kernel", "gemm_kernel"]
    assert t.kernels["short_name"].tolist() == t.kernels["name"].tolist()
    assert (t.kernels[["device_id", "stream_id", "correlation_id", "launch_ns", "launch_tid", "pid"]] == -1).all().all()
    assert t.kernels["duration_ns"].tolist() == [20, 5, 20]
    assert t.ranges["name"].tolist() == ["outer", "inner"] and t.ranges["depth"].tolist() == [0, 1]
    assert t.ranges["domain"].tolist() == ["", ""]
    assert any("runtime" in n for n in t.meta["notes"])
    assert t.meta["export_version"] is None
