"""Shared test setup: Triton kernels run under the interpreter on a machine without a GPU, and with
one fixed launch configuration everywhere (tests check results, not speed; autotuning every test
shape would cost minutes of compiles on a GPU). For the same reason fused_attention's route is not
timed on a GPU unless a test is marked `routes`: timed, a tiny test shape may go to PyTorch's SDPA and
the test would not check the kernel it was written for."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("SWINBENCH_AUTOTUNE", "0")


import lzma  # noqa: E402
import shutil  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def unxz(tmp_path_factory):
    """unxz(path_to_fixture.xz) -> a decompressed copy (SQLite needs a real file), made once per session."""
    folder = tmp_path_factory.mktemp("unxz")
    done: dict = {}

    def decompress(src):
        if src not in done:
            dst = folder / f"{len(done)}-{src.name[:-3]}"
            with lzma.open(src) as f, open(dst, "wb") as out:
                shutil.copyfileobj(f, out)
            done[src] = dst
        return done[src]

    return decompress


@pytest.fixture(autouse=True)
def _attention_routes_untimed(request, monkeypatch):
    """fused_attention's route measurement off (every shape runs the kernel, as without a GPU), except in
    tests marked `routes`; tests that replace measure_routes themselves still do."""
    if torch.cuda.is_available() and request.node.get_closest_marker("routes") is None:
        from workbench.optimize.passes import fused_attention

        monkeypatch.setattr(fused_attention, "measure_routes", lambda *args, **kwargs: {})
    yield
