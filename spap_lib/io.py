"""Atomic outputs and the run manifest.

A directory or file appears complete or not at all: everything is written into a temporary sibling
and renamed into place, so an interrupted run never leaves a half-written checkpoint or table.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MANIFEST = "spap_manifest.json"
PLAN = "spap_plan.json"


@contextmanager
def atomic_dir(path: str | os.PathLike):
    """Yield a temporary directory that replaces ``path`` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        yield tmp
        old = None
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            path.rename(old)
        tmp.rename(path)
        if old is not None:
            shutil.rmtree(old)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


@contextmanager
def atomic_file(path: str | os.PathLike):
    """Yield a temporary path that replaces ``path`` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json_atomic(path: str | os.PathLike, obj) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, default=str) + "\n")


def write_csv_atomic(path: str | os.PathLike, frame) -> None:
    """Write a pandas DataFrame as CSV atomically."""
    write_text_atomic(path, frame.to_csv(index=False))


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


def manifest(**fields) -> dict:
    """Versions, git revision, host and time, plus whatever the run adds (parameters, seed, …)."""
    import torch

    return {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git_revision": git_revision(),
        "versions": versions(),
        "host": {"machine": platform.machine(), "cuda": torch.cuda.is_available(), "threads": torch.get_num_threads()},
        **fields,
    }


def save_pruned(model, tokenizer, out_dir: str | os.PathLike, manifest_fields: dict,
                extra_files: dict[str, object] | None = None) -> Path:
    """``save_pretrained`` (safetensors) + tokenizer + manifest (+ JSON files), atomically. Stock-loadable."""
    with atomic_dir(out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        write_json_atomic(tmp / MANIFEST, manifest_fields)
        for name, obj in (extra_files or {}).items():
            write_json_atomic(tmp / name, obj)
    return Path(out_dir)
