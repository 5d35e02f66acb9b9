"""Putting an output folder in place: checks on `-o`, one writer per output, atomic replacement.

What this file is: `staged_output(out, force=..., inputs=...)`, the context manager `split` and
`merge` write through. It refuses an `-o` that is, holds or lies inside an input; takes a lock
beside the output so that a second writer refuses instead of mixing bytes; yields a fresh staging
folder with a unique name; and on success puts it in place of `out`: by exchanging the two names
(Linux renameat2 RENAME_EXCHANGE) where the system has it, else by two renames that the next run
undoes if it finds the second one missing. `--force` replaces only a folder that is a tpshard
output (a manifest and rank folders of plain files), or an empty folder; anything else is refused.

What a kill leaves: at every point either the old output or the new one is whole at `out`; the
hidden leftovers (`.NAME.tpshard-staging-*`, `.NAME.tpshard-old-*`) are removed by the next run for
the same `out`, and only when their content shows tpshard wrote them (a staging marker, or the
shape of a tpshard output); a leftover is emptied manifest last, so that a half-removed one still
shows it. `write_durably` writes one file of the staging folder and fsyncs it (the manifests, last).
What it is not: no tensor bytes, no manifest contents (the caller writes those).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import secrets
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import msgspec

from tpshard.errors import OutputError

try:
    import fcntl
except ImportError:  # Windows: no flock
    fcntl = None

# = tpshard.manifest.MANIFEST_NAME and tpshard.export.manifest.EXPORT_MANIFEST_NAME (no import: see _Envelope)
MANIFEST_NAME = "tpshard-manifest.json"
EXPORT_MANIFEST_NAME = "tpshard-export.json"
RANK_DIR = re.compile(r"rank-\d{5}")
STAGING_MARKER = ".tpshard-staging"  # inside a staging folder only; removed before it is published
SCRATCH_MARKER = ".tpshard-scratch"  # inside a scratch folder, locked by the run that made it
_TAG = ".tpshard-"  # hidden siblings of an output: .NAME.tpshard-{lock,staging-*,old-*,split-*}


def crash_point(where: str) -> None:
    """Called between the steps of a replacement; the tests kill the process here."""


class _Envelope(msgspec.Struct):
    format: str = ""  # any manifest version: only the envelope is read


class _Named(msgspec.Struct):
    name: str = ""


class _ExtraFiles(msgspec.Struct):
    extra_files: list[_Named] = []


class _ExportNames(_Envelope):
    """The names an export manifest lists (its files, the source's copied files): all an export
    folder holds besides the manifest (tpshard.export.manifest, any version)."""

    files: list[_Named] = []
    source: _ExtraFiles = msgspec.field(default_factory=_ExtraFiles)


def is_tpshard_output(path: Path) -> bool:
    """A real folder that tpshard wrote: a manifest and nothing but rank folders of plain files (a
    split or merge), or an export manifest and nothing but plain files it lists (an engine export:
    a file the user added beside them is not tpshard's to delete)."""
    try:
        if not _is_real_dir(path):
            return False
        for name, fmt, ranked in ((MANIFEST_NAME, "tpshard-manifest", True), (EXPORT_MANIFEST_NAME, "tpshard-export", False)):
            manifest = path / name
            if manifest.is_file() and not manifest.is_symlink():
                break
        else:
            return False
        envelope = msgspec.json.decode(manifest.read_bytes(), type=_Envelope if ranked else _ExportNames)
        if envelope.format != fmt:
            return False
        listed = set() if ranked else {EXPORT_MANIFEST_NAME, *(f.name for f in envelope.files), *(f.name for f in envelope.source.extra_files)}
        for entry in os.scandir(path):
            if not ranked:
                if not entry.is_file(follow_symlinks=False) or entry.name not in listed:
                    return False
            elif entry.name != MANIFEST_NAME and not (
                RANK_DIR.fullmatch(entry.name)
                and entry.is_dir(follow_symlinks=False)
                and all(e.is_file(follow_symlinks=False) for e in os.scandir(entry.path))
            ):
                return False
        return True
    except (OSError, msgspec.DecodeError, UnicodeError, RecursionError):  # nested past msgspec's depth: not ours either
        return False


def _is_real_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink()


def _is_empty_dir(path: Path) -> bool:
    return _is_real_dir(path) and not any(os.scandir(path))


def check_output_path(out: Path, inputs: Iterable[Path]) -> Path:
    """`out` as an absolute path, or a one-line refusal: not an input, not inside one, not holding one,
    not under a file, a name the file system can hold next to its staging name."""
    if out.name in ("", ".", ".."):
        raise OutputError(f"-o {out}: name a new folder, not {str(out)!r}")
    parent = Path(os.path.abspath(out.parent))
    ancestor = parent
    while not ancestor.exists() and not ancestor.is_symlink():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputError(f"-o {out}: {ancestor} is a file, not a folder")
    try:
        limit = os.pathconf(ancestor, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    longest = len(_sibling(out.name, "staging-0000000-00000000").encode())
    if len(out.name.encode()) > limit or longest > limit:
        raise OutputError(
            f"-o {out}: the name is {len(out.name.encode())} bytes; tpshard needs {longest - len(out.name.encode())}"
            f" more for its staging folder and this file system allows {limit}: choose a shorter name"
        )
    full = ancestor.resolve() / parent.relative_to(ancestor) / out.name
    for source in inputs:
        src = Path(source).resolve()
        if full == src or (out.is_symlink() and out.resolve() == src):
            raise OutputError(f"-o {out} is the input {source}; write the output somewhere else")
        if src in full.parents:
            raise OutputError(f"-o {out} lies inside the input {source}; write the output somewhere else")
        if full in src.parents:
            raise OutputError(f"-o {out} holds the input {source}; replacing it would delete the input")
    return full


def _sibling(name: str, what: str) -> str:
    return f".{name}{_TAG}{what}"


@contextlib.contextmanager
def output_lock(out: Path) -> Iterator[None]:
    """Hold `.NAME.tpshard-lock` beside `out` (flock) for the life of the block; a second writer
    refuses. The lock file is removed on release; a killed writer's lock file is free to take."""
    path = out.parent / _sibling(out.name, "lock")
    # Without flock (Windows): an exclusively created file, stale after a kill.
    while True:
        if fcntl is None:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                raise OutputError(f"{out}: another tpshard is writing it ({path} exists; delete it if no tpshard runs)") from None
            break
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise OutputError(f"{out}: another tpshard is writing it (lock {path.name} is held); wait for it or choose another -o") from None
            raise
        # The holder before us may have removed the file after we opened it: lock the file that is there.
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
        os.close(fd)


@contextlib.contextmanager
def staged_output(out: str | Path, *, force: bool, inputs: Iterable[Path] = ()) -> Iterator[Path]:
    """Yield an empty staging folder; when the block ends normally it becomes `out`, atomically.

    Refuses (OutputError, before anything is written) an `out` that is, holds or lies inside one of
    `inputs`, one that exists without `force`, and one that exists but is not a tpshard output. If
    the block raises, the staging folder is removed and `out` is as it was. OSErrors (disk full,
    read-only, permissions) become one-line OutputErrors naming the path.
    """
    out = Path(out)
    full = check_output_path(out, inputs)
    with _as_output_error(out):
        full.parent.mkdir(parents=True, exist_ok=True)
    with _as_output_error(out), output_lock(full):
        _clean_leftovers(full)
        if os.path.lexists(full):
            if not (is_tpshard_output(full) or _is_empty_dir(full)):
                raise OutputError(
                    f"{out} exists and is not a tpshard output; tpshard replaces only its own outputs"
                    " (remove it yourself or choose another -o)"
                )
            if not force:
                raise OutputError(f"{out} already exists; pass --force to replace it")
        staging = full.parent / _sibling(full.name, f"staging-{os.getpid()}-{secrets.token_hex(4)}")
        staging.mkdir()
        try:
            (staging / STAGING_MARKER).write_text(f"{full}\n")
            yield staging
            crash_point("staged")
            os.unlink(staging / STAGING_MARKER)
            _fsync_tree_dirs(staging)
            crash_point("before-publish")
            old = _publish(staging, full)
        except BaseException:
            _remove_tree(staging, last=STAGING_MARKER)
            raise
        # The new output is in place: failing to remove the old one is not a failed split (the
        # next run for this -o removes it).
        with contextlib.suppress(OSError):
            if old is not None:
                _remove_tree(old, last=_manifest_name(old))
            _fsync_dir(full.parent)


@contextlib.contextmanager
def _as_output_error(out: Path) -> Iterator[None]:
    try:
        yield
    except OSError as e:
        raise OutputError(describe_os_error(e, f"writing {out}")) from None


def describe_os_error(e: OSError, doing: str) -> str:
    where = f" ({e.filename})" if e.filename else ""
    hint = {
        errno.ENOSPC: "; free space or choose another -o",
        errno.EROFS: "; choose a writable -o",
        errno.EACCES: "; check the folder's permissions",
        errno.EDQUOT: "; free space or choose another -o",
    }.get(e.errno or 0, "")
    return f"{doing}: {e.strerror or e}{where}; nothing was written{hint}"


def _publish(staging: Path, out: Path) -> Path | None:
    """Put `staging` at `out`; return where the old output now is (to remove), if there was one."""
    if not os.path.lexists(out):
        os.rename(staging, out)
        return None
    if exchange(staging, out):
        crash_point("exchanged")  # out = new, staging = old: both whole
        return staging
    old = out.parent / _sibling(out.name, f"old-{os.getpid()}-{secrets.token_hex(4)}")
    os.rename(out, old)
    crash_point("moved-old")  # out missing, old whole: the next run puts it back
    os.rename(staging, out)
    crash_point("renamed-new")
    return old


def _load_renameat2():
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # not Linux, or a libc before glibc 2.28
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn


_renameat2 = _load_renameat2()
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def exchange(a: Path, b: Path) -> bool:
    """Swap the names `a` and `b` in one step; False where the system or file system cannot."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _clean_leftovers(out: Path) -> None:
    """Remove what killed runs for `out` left beside it, when its content shows tpshard wrote it;
    put back an old output that a kill left under its hidden name with nothing at `out`."""
    prefix = _sibling(out.name, "")
    for entry in sorted(os.listdir(out.parent)):
        if not entry.startswith(prefix):
            continue
        path, kind = out.parent / entry, entry[len(prefix) :]
        if not _is_real_dir(path):
            continue
        if kind.startswith("old-") and is_tpshard_output(path):
            if not os.path.lexists(out):
                os.rename(path, out)
            else:
                _remove_tree(path, last=_manifest_name(path))
        elif kind.startswith("staging-"):
            if (path / STAGING_MARKER).is_file():
                _remove_tree(path, last=STAGING_MARKER)
            elif is_tpshard_output(path):
                _remove_tree(path, last=_manifest_name(path))


def _manifest_name(output: Path) -> str:
    """The manifest that shows tpshard wrote `output` (an export's or a split's)."""
    return EXPORT_MANIFEST_NAME if os.path.lexists(output / EXPORT_MANIFEST_NAME) else MANIFEST_NAME


def _remove_tree(path: Path, *, last: str) -> None:
    """Remove a folder tpshard wrote, with `last` (the file that shows who wrote it) removed last."""
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(path):
            if entry.name == last:
                continue
            if entry.is_dir(follow_symlinks=False):
                for inner in os.scandir(entry.path):
                    if inner.is_dir(follow_symlinks=False):
                        _remove_tree(Path(inner.path), last="")
                    else:
                        os.unlink(inner.path)
                os.rmdir(entry.path)
            else:
                os.unlink(entry.path)
            crash_point(f"removed {entry.name}")
        if last:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path / last)
        os.rmdir(path)


@contextlib.contextmanager
def scratch_folder(out: Path) -> Iterator[Path]:
    """Yield a fresh hidden folder beside `out` (`.NAME.tpshard-split-*`) for a run's intermediate
    files (split --format's tpshard output), removed when the block ends however it ends.

    What a killed run left there is removed first: its marker file is locked (flock) for the life
    of the run that made it, so a marker nobody holds shows a dead run's folder, and one held shows
    a live run's, left alone. Without flock (Windows) a leftover is left for the user."""
    with _as_output_error(out):
        out.parent.mkdir(parents=True, exist_ok=True)
        _clean_scratch(out)
        path = Path(tempfile.mkdtemp(prefix=_sibling(out.name, "split-"), dir=out.parent))
        fd = os.open(path / SCRATCH_MARKER, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield path
    finally:
        with contextlib.suppress(OSError):
            _remove_tree(path, last=SCRATCH_MARKER)
        os.close(fd)


def _clean_scratch(out: Path) -> None:
    """Remove the scratch folders of dead runs for `out` (scratch_folder)."""
    prefix = _sibling(out.name, "split-")
    for entry in sorted(os.listdir(out.parent)):
        path = out.parent / entry
        if not entry.startswith(prefix) or not _is_real_dir(path) or fcntl is None:
            continue
        marker = path / SCRATCH_MARKER
        if not marker.is_file() or marker.is_symlink():
            with contextlib.suppress(OSError):
                path.rmdir()  # a run killed before its marker existed left it empty; else not ours to know
            continue
        fd = os.open(marker, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a live run holds it
        finally:
            os.close(fd)  # closing drops the lock taken, if it was
        with contextlib.suppress(OSError):  # another run removing it at once
            _remove_tree(path, last=SCRATCH_MARKER)


def write_durably(path: Path, data: bytes | Iterable[bytes]) -> None:
    """Write `data` (bytes, or its pieces in order) at `path` and fsync it."""
    with open(path, "wb") as f:
        for piece in [data] if isinstance(data, bytes) else data:
            f.write(piece)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # a platform that cannot open folders
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree_dirs(root: Path) -> None:
    """The names in the staged folders reach the disk before the folder is published."""
    for entry in os.scandir(root):
        if entry.is_dir(follow_symlinks=False):
            _fsync_dir(Path(entry.path))
    _fsync_dir(root)
