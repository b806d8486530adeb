"""Writing files so that nothing measured is half-written: every record, report and table goes
through `atomic_write_*` (a temporary file in the same folder, then one rename), so a kill at any
instant leaves either the old file or the new one, never a mix."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from workbench.errors import UserError


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to `path` atomically, with the permissions the file had (a new one: what `open` would
    give it under the umask, not mkstemp's owner-only 0600); UserError (one line) when the folder cannot be
    written."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        os.fchmod(fd, _mode_for(path))
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):
            raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
        raise
    return path


_UMASK = os.umask(0)     # read once, when this module is imported (reading it means setting it)
os.umask(_UMASK)


def _mode_for(path: Path) -> int:
    """The permission bits `path` has now, else 0666 less this process's umask."""
    try:
        return path.stat().st_mode & 0o7777
    except OSError:
        return 0o666 & ~_UMASK


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write `text` (UTF-8) to `path` atomically; see atomic_write_bytes."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def refuse_to_replace(path: str | os.PathLike, is_ours, what: str, inputs=(),
                      remedy: str = "give --out a new file, or move that one away") -> Path:
    """Check that writing `path` loses nothing: a path that does not exist yet, or a file that `is_ours`
    (given its first 4 KiB as text) says is `what`, the output this command wrote there before and writes
    again. A folder, one of the command's own `inputs`, or any other file is a UserError (nothing written;
    `remedy` says what to do about another file). -> path"""
    path = Path(path)
    if str(path) in ("", "."):
        raise UserError("--out names no file (empty, or the current folder): give the file to write")
    if path.is_dir():
        raise UserError(f"{path} is a folder: give --out the file to write")
    if not path.exists():
        return path
    resolved = path.resolve()
    if any(Path(i).resolve() == resolved for i in inputs):
        raise UserError(f"{path} is one of the inputs: give --out another file (nothing was written)")
    try:
        with open(path, "rb") as fh:
            head = fh.read(4096).decode("utf-8", errors="replace")
    except OSError as exc:
        raise UserError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not is_ours(head):
        raise UserError(f"{path} exists and is not {what}: {remedy} (nothing was written)")
    return path


def read_text_bounded(path: str | os.PathLike, what: str, max_bytes: int) -> str:
    """The UTF-8 text of a file the user gave, read only up to `max_bytes`; UserError (one line naming
    `what` and the file) when it cannot be read, is larger, or is not UTF-8."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            data = fh.read(max_bytes + 1)
    except OSError as exc:
        raise UserError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if len(data) > max_bytes:
        size = f"{max_bytes >> 20} MiB" if max_bytes >= 1 << 20 else f"{max_bytes >> 10} KiB"
        raise UserError(f"{what} {path} is larger than {size}; not read")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{what} {path} is not UTF-8 text (byte {exc.start})") from None


MAX_YAML_BYTES = 1 << 20
MAX_YAML_ALIASES = 100
MAX_YAML_NODES = 100_000


def load_yaml_file(path: str | os.PathLike, what: str):
    """Parse a small YAML file (a recipe, a thresholds file) with bounds a hostile file cannot pass:
    at most MAX_YAML_BYTES of UTF-8, MAX_YAML_ALIASES aliases and MAX_YAML_NODES values once aliases
    are expanded (an alias bomb of a few hundred bytes otherwise expands to gigabytes as soon as
    anything walks or prints it). Every failure is a UserError naming `what` and the file."""
    import yaml

    from workbench.errors import yaml_error_text

    path = Path(path)
    text = read_text_bounded(path, what, MAX_YAML_BYTES)

    class _BoundedLoader(yaml.SafeLoader):
        aliases = 0

        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                self.aliases += 1
                if self.aliases > MAX_YAML_ALIASES:
                    raise UserError(f"{what} {path} uses more than {MAX_YAML_ALIASES} YAML aliases; not read")
            return super().compose_node(parent, index)

        def construct_mapping(self, node, deep=False):
            # a key given twice: YAML keeps the last silently, so one of two limits or settings is lost
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                    seen.add(key)
                except TypeError:         # an unhashable key: SafeLoader says so itself
                    continue
                if duplicate:
                    line = key_node.start_mark.line + 1
                    raise UserError(f"{what} {path} gives the key {short_repr(key)} twice (line {line}); keep one")
            return super().construct_mapping(node, deep=deep)

    try:
        data = yaml.load(text, Loader=_BoundedLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise UserError(f"{what} {path} is not valid YAML{yaml_error_text(exc)}") from None
    if _expanded_size(data, MAX_YAML_NODES) > MAX_YAML_NODES:
        raise UserError(f"{what} {path} expands to more than {MAX_YAML_NODES:,} values; not read")
    return data


def _expanded_size(value, budget: int) -> int:
    """How many values `value` holds with shared (aliased) parts counted each time they appear;
    stops counting once past `budget`."""
    count, stack = 0, [value]
    while stack and count <= budget:
        item = stack.pop()
        count += 1
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return count


def short_repr(value, limit: int = 80) -> str:
    """`repr(value)` on one line, cut to `limit` characters, for error lines that quote what a file or a
    caller gave; an array-like (a tensor) by its type, dtype and shape rather than its values."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is not None and dtype is not None and not isinstance(value, (str, bytes)):
        text = f"{type(value).__name__} of {str(dtype).replace('torch.', '')} {tuple(shape)}"
    else:
        text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
