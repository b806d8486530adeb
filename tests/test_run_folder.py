"""run_folder.claim_run_folder: a folder holding an earlier run is refused and left byte for byte as it
was, --overwrite moves the run aside (nothing deleted), a live run's lock keeps a second run out, a dead
pid's lock is taken over, and the lock goes on any exit."""
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.errors import UserError
from workbench.run_folder import LOCK_NAME, claim_run_folder, run_entries


def folder_digest(folder: Path) -> str:
    """A hash of every file's relative path and bytes under `folder` (sorted)."""
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        h.update(str(p.relative_to(folder)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def earlier_run(folder: Path) -> Path:
    (folder / "records").mkdir(parents=True)
    (folder / "records" / "00-baseline.json").write_text('{"run_id": "old-run"}\n')
    (folder / "report.md").write_text("# the earlier run\n")
    (folder / "notes.txt").write_text("the user's own file\n")
    return folder


def write_lock(folder: Path, pid: int, host: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / LOCK_NAME
    lock.write_text(json.dumps({"pid": pid, "host": host or socket.gethostname(), "command": "apply",
                                "started": "2000-01-01T00:00:00"}))
    return lock


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_missing_or_empty_folder_is_claimed_and_the_lock_released(tmp_path):
    for folder in (tmp_path / "new" / "run", tmp_path):
        with claim_run_folder(folder, command="test") as claim:
            owner = json.loads((folder / LOCK_NAME).read_text())
            assert owner["pid"] == os.getpid() and owner["host"] == socket.gethostname()
            assert claim.moved_to is None and claim.notes == []
        assert not (folder / LOCK_NAME).exists()


def test_a_folder_with_an_earlier_run_is_refused_and_left_as_it_was(tmp_path):
    folder = earlier_run(tmp_path / "run")
    before = folder_digest(folder)
    with pytest.raises(UserError) as err:
        claim_run_folder(folder, command="test")
    line = str(err.value)
    assert "\n" not in line and "--overwrite" in line and "nothing was changed" in line
    assert folder_digest(folder) == before and not (folder / LOCK_NAME).exists()
    assert sorted(tmp_path.iterdir()) == [folder]


def test_overwrite_moves_the_earlier_run_aside_and_deletes_nothing(tmp_path):
    folder = earlier_run(tmp_path / "run")
    old = {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    with claim_run_folder(folder, command="test", overwrite=True, previous_tag=lambda entries: "old-run") as claim:
        assert claim.moved_to == tmp_path / "run.previous-old-run"
        assert any(str(claim.moved_to) in note for note in claim.notes)
        assert run_entries(folder) == []
    moved = {p.relative_to(claim.moved_to): p.read_bytes() for p in claim.moved_to.rglob("*") if p.is_file()}
    moved[Path("notes.txt")] = (folder / "notes.txt").read_bytes()   # not a run's file: stays where it was
    assert moved == old
    # a second overwrite does not replace the first one's folder
    (folder / "report.md").write_text("# the second run\n")
    with claim_run_folder(folder, command="test", overwrite=True, previous_tag=lambda entries: "old-run") as again:
        assert again.moved_to == tmp_path / "run.previous-old-run-2"
    assert (claim.moved_to / "report.md").read_text() == "# the earlier run\n"


def test_a_launch_log_moves_aside_with_its_run_and_alone_holds_no_run(tmp_path):
    folder = earlier_run(tmp_path / "run")
    (folder / "torchrun.log").write_text("rank 1: Traceback ...\n")
    with claim_run_folder(folder, command="test", overwrite=True, previous_tag=lambda entries: "old") as claim:
        assert (claim.moved_to / "torchrun.log").read_text() == "rank 1: Traceback ...\n"
    alone = tmp_path / "failed-launch"
    alone.mkdir()
    (alone / "torchrun.log").write_text("rank 0: no GPU\n")
    assert run_entries(alone) == []


def test_overwrite_and_keep_exclude_each_other(tmp_path):
    with pytest.raises(UserError, match="--overwrite and --resume"):
        claim_run_folder(tmp_path, command="test", overwrite=True, keep=True)


def test_a_live_runs_lock_refuses_a_second_run(tmp_path):
    folder = earlier_run(tmp_path / "run")
    write_lock(folder, os.getpid())
    before = folder_digest(folder)
    for kwargs in ({}, {"overwrite": True}, {"keep": True}):
        with pytest.raises(UserError, match=f"in use by another swinbench apply \\(pid {os.getpid()}") as err:
            claim_run_folder(folder, command="test", **kwargs)
        assert "\n" not in str(err.value)
    assert folder_digest(folder) == before


def test_a_lock_from_another_host_is_not_taken_over(tmp_path):
    write_lock(tmp_path, dead_pid(), host="some-other-host")
    with pytest.raises(UserError, match="on some-other-host"):
        claim_run_folder(tmp_path, command="test")


def test_two_claims_of_one_folder_at_once(tmp_path):
    with claim_run_folder(tmp_path, command="first"):
        with pytest.raises(UserError, match="in use by another swinbench first"):
            claim_run_folder(tmp_path, command="second")
    with claim_run_folder(tmp_path, command="second"):
        pass


def test_a_stale_lock_is_taken_over_with_a_note(tmp_path):
    pid = dead_pid()
    write_lock(tmp_path, pid)
    with claim_run_folder(tmp_path, command="test") as claim:
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
        assert len(claim.notes) == 1 and f"stale lock of {tmp_path} (pid {pid}" in claim.notes[0]
    assert list(tmp_path.iterdir()) == []


def test_an_unreadable_lock_is_refused_with_what_to_do(tmp_path):
    (tmp_path / LOCK_NAME).write_text("not json")
    with pytest.raises(UserError, match="cannot be read; if no swinbench run is writing there, delete"):
        claim_run_folder(tmp_path, command="test")


def test_the_lock_is_released_on_ctrl_c_and_sigterm(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with claim_run_folder(tmp_path, command="test"):
            raise KeyboardInterrupt
    assert not (tmp_path / LOCK_NAME).exists()
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        with claim_run_folder(tmp_path, command="test"):
            os.kill(os.getpid(), signal.SIGTERM)   # raises KeyboardInterrupt while the claim is held
            signal.pthread_sigmask(signal.SIG_BLOCK, [])   # a bytecode boundary for the handler to run at
    assert not (tmp_path / LOCK_NAME).exists()
    assert signal.getsignal(signal.SIGTERM) is handler


def test_an_output_folder_that_is_a_file_or_cannot_be_made(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="is a file"):
        claim_run_folder(tmp_path / "file", command="test")
    with pytest.raises(UserError, match="cannot create the output folder"):
        claim_run_folder(tmp_path / "file" / "run", command="test")


def test_an_empty_records_folder_is_not_a_run(tmp_path):
    """A folder whose only run-like entry is an empty `records/` holds nothing measured: a run may use it."""
    from workbench.run_folder import run_entries

    (tmp_path / "records").mkdir()
    assert run_entries(tmp_path) == []
    (tmp_path / "records" / "00-baseline.json").write_text("{}")
    assert run_entries(tmp_path) == [tmp_path / "records"]


def test_what_profile_nproc_and_apply_nproc_write_counts_as_the_run():
    """A multi-rank profile's per-rank folders, its ranks tables and capture log, and apply --nproc's
    scaling folder are the run's: --overwrite moves them aside with it, never leaves them to be written over."""
    names = ["rank0", "rank1", "ranks.csv", "ranks.json", "capture.log", "scaling", "checkpoints"]
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for name in names:
            path = folder / name
            if "." in name:
                path.write_text("x")
            else:
                path.mkdir()
                (path / "f").write_text("x")
        (folder / "notes.txt").write_text("mine")
        assert sorted(e.name for e in run_entries(folder)) == sorted(names)


def test_a_matrix_folder_or_a_part_of_another_run_is_refused(tmp_path):
    matrix = tmp_path / "matrix"
    matrix.mkdir()
    (matrix / "matrix.json").write_text("{}\n")
    with pytest.raises(UserError, match="holds a swinbench matrix"):
        claim_run_folder(matrix, command="apply", overwrite=True)
    run = earlier_run(tmp_path / "run")
    (run / "profiles").mkdir()
    (run / "profiles" / "01-amp").mkdir()
    (run / "profiles" / "01-amp" / "trace.sqlite").write_text("")
    digest = folder_digest(run)
    for part in ("records", "profiles"):
        with pytest.raises(UserError, match=f"is part of the run in .*its {part}"):
            claim_run_folder(run / part, command="apply", overwrite=True)
    assert folder_digest(run) == digest
    # nor may a new folder take a name the run writes itself: `analyze RUN` would read RUN/rank0 as its ranks
    for part in ("rank0", "logs"):
        with pytest.raises(UserError, match=f"would be part of the run in .*{part} is a name swinbench gives"):
            claim_run_folder(run / part, command="profile", overwrite=True)
    assert folder_digest(run) == digest
    with claim_run_folder(run / "mine", command="profile"):    # any other name is the user's own folder
        pass
    # a folder that merely shares a name with a run entry, beside no run, is a run folder like any other
    with claim_run_folder(tmp_path / "elsewhere" / "profiles", command="profile"):
        pass
    with claim_run_folder(matrix / "cell", command="apply"):
        pass


def test_atomic_writes_keep_the_files_permissions(tmp_path):
    from workbench.files import _UMASK, atomic_write_text

    kept = tmp_path / "kept.md"
    kept.write_text("old\n")
    kept.chmod(0o664)
    atomic_write_text(kept, "new\n")
    assert kept.stat().st_mode & 0o777 == 0o664 and kept.read_text() == "new\n"
    fresh = atomic_write_text(tmp_path / "fresh.json", "{}\n")
    assert fresh.stat().st_mode & 0o777 == 0o666 & ~_UMASK


def test_an_unwritable_folder_is_named_not_the_locks_temporary_file(tmp_path, monkeypatch):
    import errno

    def read_only(path, text, *args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(Path, "write_text", read_only)
    with pytest.raises(UserError) as err:
        claim_run_folder(tmp_path / "out", command="test")
    assert str(err.value) == f"cannot write into the output folder {tmp_path / 'out'}: Read-only file system"
