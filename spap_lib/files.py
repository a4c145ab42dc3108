"""Outputs that are complete or absent, never half-written, and never written over what is not ours.

* ``atomic_file`` / ``atomic_dir``: everything is written into a scratch sibling and moved into place
  only when complete. A directory that already exists is swapped for the new one in one step
  (Linux ``renameat2(RENAME_EXCHANGE)``), so at every instant the old or the new version is at the
  path; elsewhere the swap is two renames, and a kill between them is repaired on the next run.
* Scratch entries are named ``.<name>.spap-{tmp|old}-<host>-<pid>-<hex>``: the next write to the same
  path recognises those of dead processes on this host and removes them (restoring an interrupted
  swap first). Outputs get the user's normal permissions (umask), not the 0700/0600 of ``tempfile``.
* ``locked``: a table that several runs write is read, merged and replaced under a lock
  (``artifact.table.add_rows``); a checkpoint's records and its replacement share one (``records_lock``).

Every layer that writes (spill files, resume folders, checkpoints, tables) uses these, so they sit below
all of them; what a run's outputs contain is ``artifact.manifest``'s business.
"""
from __future__ import annotations

import ctypes
import errno
import json
import os
import platform
import re
import secrets
import shutil
import socket
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


HOST = re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:32] or "host"


# -- scratch entries and their clean-up ---------------------------------------------------------


def _scratch(path: Path, kind: str) -> Path:
    return path.with_name(f".{path.name}.spap-{kind}-{HOST}-{os.getpid()}-{secrets.token_hex(3)}")


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def leftovers(path: str | os.PathLike) -> list[Path]:
    """Scratch entries of ``path`` left by interrupted runs: this host's, whose process is gone."""
    path = Path(path)
    pattern = re.compile(rf"\.{re.escape(path.name)}\.spap-(tmp|old)-([A-Za-z0-9]+)-(\d+)-[0-9a-f]+")
    found = []
    if path.parent.is_dir():
        for entry in path.parent.iterdir():
            m = pattern.fullmatch(entry.name)
            if m and m[2] == HOST and not process_alive(int(m[3])):
                found.append(entry)
    return sorted(found)


def _remove(entry: Path) -> None:
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry)
    else:
        entry.unlink()


def clean_leftovers(path: str | os.PathLike) -> list[Path]:
    """Remove what interrupted runs left beside ``path``; if a two-rename swap was cut between its
    renames (``path`` missing, the previous version under an ``old`` name), put the previous back."""
    path = Path(path)
    found = leftovers(path)
    olds = [e for e in found if ".spap-old-" in e.name]
    if olds and not os.path.lexists(path):
        os.rename(olds[-1], path)
        found.remove(olds[-1])
    for entry in found:
        _remove(entry)
    return found


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE). False where unsupported. Kept by hand: a file
    is replaced with ``os.replace``, but no library swaps a non-empty directory for another in one step."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None) if platform.system() == "Linux" else None
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # kernel or filesystem without it
        return False
    raise OSError(err, os.strerror(err), str(b))


def _install(tmp: Path, path: Path) -> None:
    """Move the finished ``tmp`` to ``path``; an existing ``path`` ends up at ``tmp`` (removed by the caller)."""
    if not os.path.lexists(path):
        os.rename(tmp, path)
    elif not _exchange(tmp, path):
        old = _scratch(path, "old")
        os.rename(path, old)  # a kill here leaves no `path`: clean_leftovers puts `old` back
        os.rename(tmp, path)
        os.rename(old, tmp)


def _umask() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # elsewhere: read it by setting it (and put it straight back)
    os.umask(mask)
    return mask


def _normal_modes(root: Path) -> None:
    """Give everything under ``root`` the user's normal permissions: some writers (safetensors via
    transformers, tempfile) create 0600/0700 entries that other users of a shared model folder cannot read."""
    mask = _umask()
    for entry in [root, *root.rglob("*")]:
        if not entry.is_symlink():
            os.chmod(entry, (0o777 if entry.is_dir() else 0o666) & ~mask)


def _prepare(path: str | os.PathLike) -> tuple[Path, Path]:
    """The target as a Path, its folder made and dead writers' leftovers beside it removed, and a fresh scratch
    name next to it."""
    path = Path(os.path.normpath(path))  # "o/x/../q" is o/q: no folder x is made on the way
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(path)
    return path, _scratch(path, "tmp")


# The write errors a user fixes (space, quota, permissions), refused in one line naming the path.
_USER_FIXES = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up",
               errno.EROFS: "the filesystem is read-only", errno.EACCES: "permission denied"}


@contextmanager
def _named(path: Path):
    """A full disk or a read-only folder while writing ``path``: an ``OutputError`` that names ``path`` (the
    operating system's message names no file), raised after the scratch copy is gone."""
    from spap_lib.errors import OutputError

    try:
        yield
    except OSError as err:
        if err.errno not in _USER_FIXES:
            raise
        raise OutputError(f"cannot write {path} ({_USER_FIXES[err.errno]}): free some space or write it "
                          "somewhere else (a larger or writable disk)") from None


@contextmanager
def atomic_dir(path: str | os.PathLike, *, records: bool = False):
    """Yield a scratch directory that replaces ``path`` only if the block succeeds; ``records``: the replacement
    waits for whoever holds ``records_lock(path)`` (an evaluation being recorded in the old version)."""
    with _named(Path(path)):
        path, tmp = _prepare(path)
        os.mkdir(tmp)
        try:
            yield tmp
            _normal_modes(tmp)
            if records:
                with locked(records_lock(path)):
                    _install(tmp, path)
            else:
                _install(tmp, path)
        finally:
            if os.path.lexists(tmp):
                _remove(tmp)  # the failed new version, or the replaced old one


@contextmanager
def atomic_file(path: str | os.PathLike):
    """Yield a scratch path (an empty file) that replaces ``path`` only if the block succeeds."""
    with _named(Path(path)):
        path, tmp = _prepare(path)
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        try:
            yield tmp
            os.chmod(tmp, 0o666 & ~_umask())  # a writer may have replaced it with a 0600 file
            os.replace(tmp, path)
        finally:
            if os.path.lexists(tmp):
                os.remove(tmp)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, default=str) + "\n")


def write_csv_atomic(path: str | os.PathLike, frame) -> None:
    """Write a pandas DataFrame as CSV atomically."""
    write_text_atomic(path, frame.to_csv(index=False))


@contextmanager
def locked(path: str | os.PathLike):
    """An exclusive lock on ``<path>.lock`` (``filelock``) for a read-modify-write of ``path``: two processes
    adding rows to one table (two grids, a grid and 04) each keep the other's rows."""
    from filelock import FileLock

    lock = Path(f"{path}.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(lock):
        yield


def records_lock(folder: str | os.PathLike) -> Path:
    """What ``locked`` takes for a checkpoint folder's records (manifest, card) and for its replacement: a hidden
    name beside the folder, not in it, so that the lock outlives a replacement and is no file of the model."""
    folder = Path(folder)
    return folder.with_name(f".{folder.name}.spap-records")


# -- where spap keeps what it assembles and hashes --------------------------------------------------


def cache_dir() -> Path | None:
    """spap's one cache folder: assembled model files, GGUF conversions (``model.converted``) and the record of
    large files' digests (``keys.file_digest``). ``$SPAP_CACHE_DIR``, else ``$XDG_CACHE_HOME/spap``, else
    ~/.cache/spap; None where ``SPAP_CACHE_DIR=off``: nothing is kept between processes."""
    named = os.environ.get("SPAP_CACHE_DIR")
    if named == "off":
        return None
    if named:
        return Path(named).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "spap"


def hub_snapshot(repo: str) -> Path | None:
    """The folder of ``repo``'s snapshot in the local hub cache (huggingface_hub's look-up under ``HF_HOME``; no
    network), or None where it is not cached."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(repo, "config.json")
    except Exception:  # noqa: BLE001 - an id the cache cannot hold: loading names the problem
        return None
    return Path(found).parent if isinstance(found, str) else None
