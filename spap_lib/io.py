"""Outputs that are complete or absent, never half-written, and never written over what is not ours.

* ``atomic_file`` / ``atomic_dir``: everything is written into a scratch sibling and moved into place
  only when complete. A directory that already exists is swapped for the new one in one step
  (Linux ``renameat2(RENAME_EXCHANGE)``), so at every instant the old or the new version is at the
  path; elsewhere the swap is two renames, and a kill between them is repaired on the next run.
* Scratch entries are named ``.<name>.spap-{tmp|old}-<host>-<pid>-<hex>``: the next write to the same
  path recognises those of dead processes on this host and removes them (restoring an interrupted
  swap first). Outputs get the user's normal permissions (umask), not the 0700/0600 of ``tempfile``.
* ``check_out_dir``: a checkpoint directory is written only where it is new, empty, or holds a
  previous spap checkpoint (with ``overwrite``); never over a foreign directory, the source model
  or the run folder. Checked before any work and again just before the swap.
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
import subprocess
import time
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

from .errors import OutputError, option

REPO = Path(__file__).resolve().parent.parent
MANIFEST = "spap_manifest.json"
PLAN = "spap_plan.json"
CHECKPOINT_FORMAT = 1
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
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE). False where unsupported."""
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


@contextmanager
def atomic_dir(path: str | os.PathLike):
    """Yield a scratch directory that replaces ``path`` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(path)
    tmp = _scratch(path, "tmp")
    os.mkdir(tmp)
    try:
        yield tmp
        _normal_modes(tmp)
        _install(tmp, path)
    finally:
        if os.path.lexists(tmp):
            _remove(tmp)  # the failed new version, or the replaced old one


@contextmanager
def atomic_file(path: str | os.PathLike):
    """Yield a scratch path (an empty file) that replaces ``path`` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_leftovers(path)
    tmp = _scratch(path, "tmp")
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
    """An exclusive advisory lock on ``<path>.lock`` for a read-modify-write of ``path``: two processes
    adding rows to one table (two grids, a grid and 04) each keep the other's rows."""
    import fcntl

    lock = Path(f"{path}.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def upsert_csv(path: str | os.PathLike, new, key: list[str]):
    """Write ``new``'s rows into the CSV at ``path`` (atomically, under ``locked``): earlier rows with the
    same ``key`` values are replaced, all others (other models, other cells, other processes' rows) kept.
    The file is read again every time, so rows another process added meanwhile stay. Returns the table."""
    import pandas as pd

    path = Path(path)
    with locked(path):
        table = pd.read_csv(path, keep_default_na=False) if path.is_file() else pd.DataFrame()
        if not table.empty and not new.empty:
            same = table[key].astype(str).apply(tuple, axis=1).isin(new[key].astype(str).apply(tuple, axis=1))
            table = table[~same]
        table = pd.concat([table, new], ignore_index=True)
        write_csv_atomic(path, table)
    return table


# -- where a checkpoint may be written ------------------------------------------------------------

def read_checkpoint_manifest(path: str | os.PathLike) -> dict | None:
    """The manifest of a spap checkpoint directory, or None if ``path`` is not one."""
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict):
        return None
    if "spap_checkpoint" in manifest:
        return manifest
    # Checkpoints written before the format marker: spap's version and a method in the manifest.
    legacy = isinstance(manifest.get("versions"), dict) and "spap" in manifest["versions"] and "method" in manifest
    return manifest if legacy else None


def _writable(directory: Path) -> None:
    """Create and remove a probe entry: the only test that also holds for read-only mounts."""
    probe = directory / f".spap-probe-{os.getpid()}-{secrets.token_hex(3)}"
    try:
        os.mkdir(probe)
        os.rmdir(probe)
    except OSError as err:
        raise OutputError(f"cannot write in {directory} ({err.strerror}): choose an out_dir in a writable "
                          "directory") from None


def check_out_dir(out_dir: str | os.PathLike, *, overwrite: bool = False,
                  protect: dict[str, str | os.PathLike] | None = None) -> str:
    """Refuse, before any work, an ``out_dir`` that spap may not (re)write; say why and what to do.

    Allowed: a path that does not exist, an empty directory, or (``overwrite=True``) a previous spap
    checkpoint holding only the files its manifest lists. ``protect`` maps a description to a path
    that must survive (the source model, the run folder): ``out_dir`` may be neither it nor an
    ancestor of it. Returns ``"new"``, ``"empty"`` or ``"checkpoint"``.
    """
    if not isinstance(overwrite, bool):
        raise OutputError(f"overwrite must be True or False, got {overwrite!r}")
    if not str(out_dir).strip() or Path(out_dir).name in ("", ".", ".."):
        raise OutputError(f"out_dir {str(out_dir)!r} names no new folder (the checkpoint is written beside it and "
                          f"moved into place): give a folder name, e.g. {option('out', 'pruned')}")
    out = Path(out_dir).expanduser().absolute()
    real = out.resolve()
    for what, keep in (protect or {}).items():
        keep = Path(keep).expanduser().resolve()
        if real == keep or real in keep.parents:
            raise OutputError(f"out_dir {out} would replace {what} ({keep}): choose another out_dir")
    if out.parent.is_dir():
        clean_leftovers(out)  # an interrupted earlier run: restore or remove what it left
    state = "new"
    if os.path.lexists(out):
        if not out.is_dir():
            raise OutputError(f"out_dir {out} exists and is not a directory: choose another out_dir")
        names = sorted(p.name for p in out.iterdir())
        state = "empty"
        if names:
            manifest = read_checkpoint_manifest(out)
            if manifest is None:
                shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
                raise OutputError(f"out_dir {out} is not empty and is not a spap checkpoint (it holds {shown}): "
                                  "spap never replaces a directory it did not write. Choose a new or empty out_dir.")
            listed = manifest.get("spap_checkpoint", {}).get("files")
            extra = sorted(set(names) - set(listed)) if listed is not None else []
            if extra:
                raise OutputError(f"out_dir {out} holds a spap checkpoint and files spap did not write "
                                  f"({', '.join(extra[:5])}): move them away or choose another out_dir")
            if not overwrite:
                what = f"{manifest.get('method', '?')} at sparsity {manifest.get('sparsity', {}).get('requested', '?')}"
                raise OutputError(f"out_dir {out} holds a previous spap checkpoint "
                                  f"({what}, {manifest.get('created', '')}): "
                                  f"pass {option('overwrite')} to replace it, or choose another out_dir")
            state = "checkpoint"
            _writable(out)  # its old files are removed after the swap
    parent = out.parent
    while not parent.exists():  # parents are created on save; the first existing one must be writable
        parent = parent.parent
    _writable(parent)
    return state


# -- manifests ----------------------------------------------------------------------------------

def git_revision() -> str | None:
    try:
        rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return rev + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def versions() -> dict:
    out = {"python": platform.python_version()}
    for dist in ("spap", "torch", "transformers", "datasets", "gguf", "lm_eval", "papermill"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def cpu_name() -> str:
    """The processor's model name: a CPU's kernels (bf16 products, above all) differ between processors, and so do
    the last digits of a CPU run's results (``make main``: 37.916 on one x86 CPU, 37.924 on another)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device) -> str:
    """What a measurement ran on, for a benchmark's header: the GPU's name, or the CPU's with its threads."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_name()}, {torch.get_num_threads()} threads"


def manifest(**fields) -> dict:
    """Versions, git revision, host and time, plus whatever the run adds (parameters, seed, …); the host's CPU with
    the kernels its bf16 products run on (``bf16.kernels``)."""
    import torch

    from . import bf16

    return {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git_revision": git_revision(),
        "versions": versions(),
        "host": {"machine": platform.machine(), "cpu": cpu_name(), "cuda": torch.cuda.is_available(),
                 "threads": torch.get_num_threads(), "bf16_products": bf16.kernels("cpu")},
        **fields,
    }


def save_pruned(model, tokenizer, out_dir: str | os.PathLike, manifest_fields: dict,
                extra_files: dict[str, object] | None = None, *, overwrite: bool = False,
                protect: dict | None = None, check=None, write=None) -> Path:
    """``save_pretrained`` (safetensors) + tokenizer + JSON files + manifest, installed atomically.

    ``write(tmp)`` replaces ``model.save_pretrained`` (an offloaded model writes its own shards).
    ``check(tmp) -> dict`` runs on the finished scratch copy before it is installed (the reload
    check): if it raises, ``out_dir`` is left exactly as it was. Its result is stored in the
    manifest under ``checks``. Stock-loadable.
    """
    check_out_dir(out_dir, overwrite=overwrite, protect=protect)
    with atomic_dir(out_dir) as tmp:
        (write or (lambda folder: model.save_pretrained(folder, safe_serialization=True)))(tmp)
        tokenizer.save_pretrained(tmp)
        for name, obj in (extra_files or {}).items():
            write_json_atomic(tmp / name, obj)
        checks = check(tmp) if check else {}
        files = sorted({p.name for p in tmp.iterdir()} | {MANIFEST})
        write_json_atomic(tmp / MANIFEST, {**manifest_fields, "checks": checks,
                                           "spap_checkpoint": {"format": CHECKPOINT_FORMAT, "files": files}})
        check_out_dir(out_dir, overwrite=overwrite, protect=protect)  # unchanged while we worked?
    return Path(out_dir)
