"""Claiming an output folder for one run, so that nothing measured is ever lost.

`swinbench apply`, `swinbench profile` and `swinbench train` write a run into one folder. Before they write
anything, `claim_run_folder` makes sure of two things:

- the folder holds no other run, unless the user chose what happens to it: `overwrite` moves the old
  run's files aside into a sibling folder `<folder>.previous-<its run id or time>` (nothing is deleted),
  `keep` (apply --resume) continues it in place. Otherwise the claim is refused with one line and the
  folder is left exactly as it was. A folder that does not exist, is empty or holds only files that
  swinbench does not write is fine.
- no other swinbench process writes into it at the same time: a lock file `<folder>/.swinbench.lock`,
  created atomically, holds the owner's pid and host. A second run is refused while that pid lives; a
  lock whose pid is dead on this host is taken over (the claim's notes say so). The lock is released
  when the claim ends, on any exit including Ctrl-C and SIGTERM (turned into KeyboardInterrupt while
  the claim is held).
"""
from __future__ import annotations

import datetime as _dt
import fnmatch
import json
import os
import re
import signal
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from workbench.errors import UserError

LOCK_NAME = ".swinbench.lock"

# What apply, profile and train write into a run folder. An entry of one of these names means the folder
# holds a run; `overwrite` moves exactly these aside and leaves anything else where it is.
RUN_ENTRY_PATTERNS = (
    "records", "report.md", "report-categories.png", "curves.png", "logs", "profiles", "reference.pt", "reference.tmp",
    "checkpoints", "scaling", "rank[0-9]*", "ranks.*", "capture.log", "torchrun.log",
    "run.json", "launches.json", "trace.*", "capture_spec.json", "nsys.log",
    "kernels*.csv", "categories*.csv", "ranges*.csv", "busy*.csv", "api*.csv", "findings*.csv", "floors*.csv", "analysis*.json",
    "timeline.png", "timeline.json",
    ".*.tmp",  # an atomic write cut short by a hard kill
)


# The tables of `swinbench matrix`: a folder holding them is a matrix, whose cells (its subfolders) are runs
MATRIX_MD = "matrix.md"
MATRIX_JSON = "matrix.json"


# What a capture or a torchrun launch writes before it measures anything: a folder holding nothing else
# holds no run (a capture or launch that failed at its start leaves them, and the next run into the folder
# writes them again); beside a run's other files they are moved aside with them
NOT_MEASURED = ("capture.log", "nsys.log", "capture_spec.json", "torchrun.log")


def run_entries(folder: Path) -> list[Path]:
    """The entries of `folder` that a swinbench run wrote (RUN_ENTRY_PATTERNS), sorted; [] when the
    folder does not exist or holds only NOT_MEASURED files. An empty folder among them holds nothing
    measured and does not count."""
    try:
        names = sorted(os.listdir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        raise UserError(f"cannot read the output folder {folder}: {exc.strerror or exc}") from None
    entries = [Path(folder) / n for n in names
               if n != LOCK_NAME and any(fnmatch.fnmatchcase(n, p) for p in RUN_ENTRY_PATTERNS)]
    entries = [e for e in entries if not (e.is_dir() and not any(e.iterdir()))]
    return [] if all(e.name in NOT_MEASURED for e in entries) else entries


def check_writable_folder(folder) -> None:
    """UserError (one line) unless `folder` is, or can be made as, a folder this process may write in:
    not a file, and its nearest existing ancestor a writable folder. Creates nothing."""
    probe = Path(os.path.abspath(folder))
    if probe.exists() and not probe.is_dir():
        raise UserError(f"cannot write to {folder}: it is a file, not a folder")
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise UserError(f"cannot write to {folder}: {probe} is a file, not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(f"cannot write to {folder}: {probe} is not writable")


def newest_time_tag(paths: list[Path]) -> str:
    """YYYYmmdd-HHMMSS of the newest modification among `paths` (the time an old run last wrote)."""
    times = []
    for p in paths:
        try:
            times.append(p.stat().st_mtime)
        except OSError:
            pass
    when = _dt.datetime.fromtimestamp(max(times)) if times else _dt.datetime.now()
    return when.strftime("%Y%m%d-%H%M%S")


def previous_folder(folder: Path, tag: str) -> Path:
    """`<folder>.previous-<tag>` beside `folder` (tag cleaned to a file name), or with -2, -3 ... added
    when that exists already."""
    folder = Path(os.path.abspath(folder))
    clean = re.sub(r"[^A-Za-z0-9._-]+", "_", tag).strip("._")[:80] or "run"
    base = folder.parent / f"{folder.name}.previous-{clean}"
    candidate, n = base, 1
    while candidate.exists():
        n += 1
        candidate = base.with_name(f"{base.name}-{n}")
    return candidate


def move_aside(entries: list[Path], dest: Path) -> Path:
    """Move `entries` (files or folders) into the new folder `dest`, keeping their names -> dest.
    Renames only: nothing is copied or deleted."""
    try:
        dest.mkdir(parents=True, exist_ok=False)
        for entry in entries:
            os.rename(entry, dest / entry.name)
    except OSError as exc:
        raise UserError(f"cannot move the earlier files aside to {dest}: {exc.strerror or exc}") from None
    return dest


# ---------------------------------------------------------------- the lock


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # alive, another user's
        return True
    except OSError:
        return True
    return True


def _read_lock(path: Path) -> dict | None:
    """The lock's {pid, host, command, started}, None when it is gone; {} when it cannot be parsed."""
    try:
        text = path.read_text()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        owner = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return owner if isinstance(owner, dict) and isinstance(owner.get("pid"), int) else {}


def _held_by_other(owner: dict) -> bool:
    """Whether the lock's owner may still be running (a pid dead on this host is not)."""
    return owner.get("host") != socket.gethostname() or _pid_alive(owner["pid"])


def _in_use(folder: Path, owner: dict) -> UserError:
    lock = folder / LOCK_NAME
    if not owner:
        return UserError(f"{folder} is locked by {lock}, which cannot be read; if no swinbench run is writing "
                         "there, delete that file")
    return UserError(f"{folder} is in use by another swinbench {owner.get('command', 'run')} (pid {owner['pid']} "
                     f"on {owner.get('host')}, since {owner.get('started', '?')}); wait for it to end or choose "
                     f"another --out (if no such run exists, delete {lock})")


def check_unlocked(folder: Path) -> None:
    """UserError when a live run holds `folder`'s lock (reads only; a stale lock passes)."""
    owner = _read_lock(Path(folder) / LOCK_NAME)
    if owner is not None and (not owner or _held_by_other(owner)):
        raise _in_use(Path(folder), owner)


def _create_exclusive(complete: Path, path: Path, text: str) -> None:
    """Create `path` holding `text`, FileExistsError when it exists: a hard link of the complete file
    `complete` (the lock appears whole or not at all), or O_EXCL where the file system has no links."""
    try:
        os.link(complete, path)
        return
    except FileExistsError:
        raise
    except OSError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


class FolderLock:
    """`<folder>/.swinbench.lock`, created atomically (a complete temporary file hard-linked into place,
    which fails when the lock exists) with this process's pid and host."""

    def __init__(self, folder: Path, command: str):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.command = command
        self.notes: list[str] = []
        self.held = False
        self._old_sigterm = None

    def take(self) -> "FolderLock":
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"cannot create the output folder {self.folder}: {exc.strerror or exc}") from None
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "command": self.command,
                 "started": _dt.datetime.now().isoformat(timespec="seconds")}
        text = json.dumps(owner) + "\n"
        tmp = self.folder / f".swinbench.lock.{os.getpid()}.tmp"
        try:   # written whole before it is linked into place, so a plain write will do
            tmp.write_text(text)
        except OSError as exc:   # the folder, not the lock's temporary file, is what the user named
            raise UserError(f"cannot write into the output folder {self.folder}: {exc.strerror or exc}") from None
        try:
            for _ in range(2):
                try:
                    _create_exclusive(tmp, self.path, text)
                    break
                except FileExistsError:
                    self._take_over_if_stale()   # raises when a live run holds it
            else:
                raise _in_use(self.folder, _read_lock(self.path) or {})
        except OSError as exc:
            raise UserError(f"cannot lock the output folder {self.folder}: {exc.strerror or exc}") from None
        finally:
            tmp.unlink(missing_ok=True)
        self.held = True
        self._catch_sigterm()
        return self

    def _take_over_if_stale(self) -> None:
        """Remove the existing lock when its pid is dead on this host (and say so), else UserError."""
        owner = _read_lock(self.path)
        if owner is None:
            return   # released meanwhile
        if not owner or _held_by_other(owner):
            raise _in_use(self.folder, owner)
        # Rename before removing, so that of two runs taking over at once only one removes it.
        aside = self.path.with_name(f"{LOCK_NAME}.stale.{os.getpid()}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        if _read_lock(aside) != owner:   # another run's fresh lock came in between: put it back
            try:
                os.link(aside, self.path)
            finally:
                aside.unlink(missing_ok=True)
            raise _in_use(self.folder, _read_lock(self.path) or {})
        aside.unlink(missing_ok=True)
        self.notes.append(f"took over the stale lock of {self.folder} (pid {owner['pid']} on this host, "
                          f"started {owner.get('started', '?')}, is no longer running)")

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        self._restore_sigterm()
        owner = _read_lock(self.path)
        if owner and owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname():
            self.path.unlink(missing_ok=True)

    def _catch_sigterm(self) -> None:
        """While the lock is held, SIGTERM raises KeyboardInterrupt, so the run ends as on Ctrl-C (its
        finished work written, the lock released)."""
        if threading.current_thread() is not threading.main_thread():
            return

        def interrupt(signum, frame):
            raise KeyboardInterrupt

        self._old_sigterm = signal.signal(signal.SIGTERM, interrupt)

    def _restore_sigterm(self) -> None:
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None


# ---------------------------------------------------------------- the claim


@dataclass
class FolderClaim:
    """A folder held for one run: `with claim:` releases its lock on any exit. moved_to: where an
    earlier run's files went (overwrite), else None. notes: lines to show the user."""

    folder: Path
    lock: FolderLock
    moved_to: Path | None = None
    notes: list[str] = field(default_factory=list)

    def release(self) -> None:
        self.lock.release()

    def __enter__(self) -> "FolderClaim":
        return self

    def __exit__(self, *exc) -> bool:
        self.release()
        return False


def refuse_part_of_another(folder: Path) -> None:
    """UserError (one line) when `folder` is no place for a run of its own: a matrix folder (its cells are
    its subfolders), or a part of another run (its records/, profiles/, ...), where the run's files would
    mix with what report, check and resume read as that run's."""
    folder = Path(folder)
    held = [n for n in (MATRIX_JSON, MATRIX_MD) if (folder / n).is_file()]
    if held:
        raise UserError(f"{folder} holds a swinbench matrix ({held[0]}); its cells are its subfolders: choose "
                        "another --out")
    refuse_inside_a_run(folder)


def refuse_inside_a_run(folder: Path) -> None:
    """UserError (one line) when `folder` is a part of another run (its records/, profiles/, ...), or would
    become one: a name of RUN_ENTRY_PATTERNS (rank0, profiles, ...) inside a folder that holds a run, where
    analyze, report and --overwrite would take it for that run's own."""
    folder = Path(folder)
    here = Path(os.path.abspath(folder))
    parent = here.parent
    if parent != here and any(fnmatch.fnmatchcase(here.name, p) for p in RUN_ENTRY_PATTERNS):
        names = [e.name for e in run_entries(parent)]
        if here.name in names and len(names) > 1:
            raise UserError(f"{folder} is part of the run in {parent} (its {here.name}): choose another --out")
        if here.name not in names and names:
            raise UserError(f"{folder} would be part of the run in {parent} ({', '.join(names[:3])}"
                            f"{', ...' if len(names) > 3 else ''}): {here.name} is a name swinbench gives a run's own "
                            "files, so analyze, report and --overwrite would take it for that run's; choose "
                            "another --out")


def refuse_records_folder(folder: Path) -> None:
    """UserError (one line) when `folder` holds stage records (a run's records/): whatever else is written
    there, report, check and resume read every *.json in it as that run's."""
    folder = Path(folder)
    record = stage_record_in(folder)
    if record is not None:
        raise UserError(f"{folder} holds stage records ({record.name}), which report, check and --resume read as "
                        "one run's: choose another --out")


def stage_record_in(folder: Path, besides: Path | None = None) -> Path | None:
    """A stage record (a *.json not starting with '_' whose schema is swinbench.stage/...) among the first
    files of `folder` other than `besides`, or None: report and check read every such file as a record."""
    folder = Path(folder)
    if not folder.is_dir():
        return None
    for q in sorted(folder.glob("*.json"))[:20]:
        if (q.is_file() and not q.name.startswith("_") and q.stat().st_size < 10 * 2**20
                and (besides is None or q.resolve() != Path(besides).resolve())):
            try:
                schema = json.loads(q.read_text(encoding="utf-8")).get("schema")
            except (OSError, ValueError, AttributeError):
                continue
            if isinstance(schema, str) and schema.startswith("swinbench.stage/"):
                return q
    return None


def refuse_overwrite_and_resume(overwrite: bool, resume: bool) -> None:
    """The user asked to move the folder's run aside and to continue it: one line, before anything else."""
    if overwrite and resume:
        raise UserError("--overwrite and --resume exclude each other: --resume continues the run in the "
                        "folder, --overwrite moves it aside")


def claim_run_folder(folder, *, command: str, overwrite: bool = False, keep: bool = False,
                     refusal: Callable[[list[Path], Path], str] | None = None,
                     previous_tag: Callable[[list[Path]], str] | None = None) -> FolderClaim:
    """Lock `folder` for one run of `command` (creating it), after making sure no earlier run in it is
    changed without the user's choice.

    overwrite: move an earlier run's files (run_entries) aside to previous_folder(folder, tag), tag from
    previous_tag(entries) (default: the newest entry's time). keep: the caller continues the run there
    (its own checks decide whether it may). With neither, a folder that holds a run is refused with
    UserError(refusal(entries, previous_folder)) before anything is written; the default line names
    --overwrite. Raises UserError when a live run holds the lock or the folder cannot be written."""
    refuse_overwrite_and_resume(overwrite, keep)
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"the output folder {folder} is a file")
    tag_of = previous_tag or newest_time_tag

    def refuse_if_held(entries: list[Path]) -> None:
        if entries and not (overwrite or keep):
            dest = previous_folder(folder, tag_of(entries))
            raise UserError(refusal(entries, dest) if refusal else
                            f"{folder} holds an earlier run ({', '.join(e.name for e in entries[:4])}"
                            f"{', ...' if len(entries) > 4 else ''}); nothing was changed: --overwrite moves "
                            f"it aside to {dest}, or choose another --out")

    refuse_part_of_another(folder)
    check_unlocked(folder)                 # reads only: a refusal leaves the folder as it was
    refuse_if_held(run_entries(folder))
    lock = FolderLock(folder, command).take()
    claim = FolderClaim(folder, lock, notes=list(lock.notes))
    try:
        entries = run_entries(folder)      # again, under the lock
        refuse_if_held(entries)
        if entries and overwrite:
            claim.moved_to = move_aside(entries, previous_folder(folder, tag_of(entries)))
            claim.notes.append(f"moved the earlier run in {folder} aside to {claim.moved_to}")
    except BaseException:
        lock.release()
        raise
    return claim
