"""What every cache and resume folder is keyed by: the content it was computed from, never a path.

A result reused from a cache (``dense.json``, ``calibration.pt``) or a resume folder was computed from a
model (weights, config, tokenizer), data and settings. Keyed by the model's path, a model replaced at the
same path would be served the old model's numbers; keyed by content, a changed source is a recomputation
or a refusal, and the same model at another path (a relative path, a copy on another host) is the same key.

Hashing a large model on every run would cost seconds per run, so ``file_digest`` hashes a file once and
records the digest beside the file's identity (size, modification and change times, inode) in
``<cache>/digests.json``; any replacement of the file changes that identity, so the record is never
trusted for other content.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from spap_lib.errors import SourceError
from spap_lib.files import cache_dir, hub_snapshot, locked, write_json_atomic

# Files of a checkpoint folder that describe it without deciding its model: spap's manifest and model card
# (``spap eval`` appends its evaluations to them).
NOT_CONTENT = ("spap_manifest.json", "README.md")


def _memo_path() -> Path | None:
    root = cache_dir()
    return None if root is None else root / "digests.json"


def _identity(path: Path) -> list:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def sha256_of(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's content, read in blocks: spap's one file hash (``file_digest`` records it)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def file_digest(path: str | os.PathLike, memo_above: int = 1 << 24) -> str:
    """The sha256 of ``path``'s content; files over ``memo_above`` bytes are hashed once per identity."""
    path = Path(path).resolve()
    identity = _identity(path)
    memo = _memo_path()
    if identity[0] <= memo_above or memo is None:  # small, or the cache is off: hashed every time
        return sha256_of(path)
    try:
        known = json.loads(memo.read_text()).get(str(path)) if memo.is_file() else None
    except (OSError, ValueError):  # a damaged record is only a lost shortcut
        known = None
    if isinstance(known, dict) and known.get("identity") == identity and isinstance(known.get("sha256"), str):
        return known["sha256"]
    sha = sha256_of(path)
    try:
        with locked(memo):
            try:
                records = json.loads(memo.read_text()) if memo.is_file() else {}
            except ValueError:
                records = {}
            records = records if isinstance(records, dict) else {}
            records[str(path)] = {"identity": identity, "sha256": sha}
            write_json_atomic(memo, records)
    except OSError:  # a read-only cache: hashed again next time, still correct
        pass
    return sha


def folder_digests(folder: str | os.PathLike, memo: bool = True) -> dict[str, str]:
    """``{name: sha256}`` of every file that decides a checkpoint folder's model (all but ``NOT_CONTENT``
    and hidden files); ``memo=False`` for a scratch folder about to be renamed (its records would be stale)."""
    folder = Path(folder)
    above = 1 << 24 if memo else float("inf")
    return {p.name: file_digest(p, above) for p in sorted(folder.iterdir())
            if p.is_file() and p.name not in NOT_CONTENT and not p.name.startswith(".")}


def check_folder_digests(folder: str | os.PathLike) -> None:
    """A checkpoint spap wrote lists its files' digests in its manifest: each must be there, unchanged (a
    flipped byte in a weight or a config value is otherwise a valid checkpoint of another model)."""
    folder = Path(folder)
    path = folder / NOT_CONTENT[0]
    if not path.is_file():
        return
    try:
        digests = json.loads(path.read_text())["spap_checkpoint"].get("digests", {})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise SourceError(f"{path} is damaged ({type(err).__name__}): restore the checkpoint, or delete the file "
                          "to load the checkpoint without its checks") from None
    for name, sha in digests.items():
        if not (folder / name).is_file():
            raise SourceError(f"{folder} lacks {name}, which its {NOT_CONTENT[0]} lists: the copy is incomplete; "
                              "copy or save the checkpoint again")
        if file_digest(folder / name) != sha:
            raise SourceError(f"{folder / name} differs from the file spap saved (its sha256 is not the one "
                              f"{NOT_CONTENT[0]} records): the file is damaged or was edited; save or copy the "
                              "checkpoint again")


def source_key(source) -> str:
    """One string naming a ``ModelSource``'s content: a digest of its files' digests (a folder, a GGUF file),
    or for a hub id, the snapshot the local hub cache holds (its commit)."""
    where = Path(source.path) / (source.gguf_file or "")
    if source.kind in ("gguf", "dir") and not where.exists():  # a model built in memory: its name is all there is
        return f"name:{source.name}"
    if source.kind == "gguf":
        parts = {source.gguf_file: file_digest(where)}
    elif source.kind == "dir":
        parts = folder_digests(source.path)
    else:
        parts = {"hub": source.path, "snapshot": getattr(hub_snapshot(source.path), "name", None)}
    return parts_key(parts)


def parts_key(parts: dict) -> str:
    """One short name for a dict of digests (a folder's files, a GGUF, a hub snapshot): what a model is keyed by."""
    return "sha256:" + hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def code_digest(*modules) -> str:
    """A short hash of the modules' source: results computed by other code are not reused."""
    import inspect

    digest = hashlib.sha256()
    for module in modules:
        digest.update(inspect.getsource(module).encode())
    return digest.hexdigest()[:16]


def tokenizer_digest(tokenizer) -> str:
    """A short hash of how ``tokenizer`` turns text into ids: a fast tokenizer's whole definition (normalizer,
    pre-tokenizer, model, post-processor, added tokens), else its class and vocabulary. Ids drawn by another
    tokenizer of the same model are other ids, so a cache or a row of another digest is not this run's."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else \
        json.dumps([type(tokenizer).__name__, sorted(tokenizer.get_vocab().items())])
    return hashlib.sha256(text.encode()).hexdigest()[:16]
