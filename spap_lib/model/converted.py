"""A GGUF model converted once: its dequantized weights (safetensors), config and tokenizer in a cache folder keyed
by the GGUF file's content.

Reading a GGUF through ``transformers`` parses its metadata (the whole vocabulary among it) for the config, the
tokenizer and the weights, and maps every tensor name, on every load; a safetensors folder loads in a fraction of
that time (docs/gguf.md). The folder is named by the file's SHA-256 and carries a record
of that digest and of the ``transformers`` version that converted it, so a changed file or converter is a new
conversion, never a reuse; a folder that does not load is removed and made again.

The folders live in spap's cache folder (``files.cache_dir``: ``SPAP_CACHE_DIR``; ``off`` keeps none).
"""
from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

import torch

from spap_lib.files import atomic_dir, cache_dir, write_json_atomic
from spap_lib.keys import file_digest

RECORD = "spap_converted.json"


def _entry(root: Path, gguf: Path) -> tuple[Path, dict]:
    """The cache folder of this GGUF file under ``root``, and the record a conversion there must carry."""
    import transformers

    expected = {"gguf_sha256": file_digest(gguf), "gguf_size": gguf.stat().st_size,
                "transformers": transformers.__version__}
    return root / "gguf" / expected["gguf_sha256"][:32], expected


def folder(gguf: str | os.PathLike) -> Path | None:
    """The cache folder of this GGUF file where it holds a complete conversion of exactly this file by this
    ``transformers``; else None."""
    root = cache_dir()
    if root is None:
        return None
    path, expected = _entry(root, Path(gguf))
    try:
        record = json.loads((path / RECORD).read_text())
    except (OSError, ValueError):
        return None
    if {k: record.get(k) for k in expected} != expected or not all((path / f).is_file() for f in record["files"]):
        return None
    return path


def load_converted(path: Path, dtype: torch.dtype, name_or_path: str):
    """The converted model and tokenizer, or None (the folder is removed) when they do not load. The config reads
    as the GGUF's did: named by ``name_or_path``, its ``architectures`` as the GGUF gave them (``save_pretrained``
    fills them in)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        record = json.loads((path / RECORD).read_text())
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=False)
        model.config._name_or_path, model.config.architectures = name_or_path, record["architectures"]
    except Exception as err:  # noqa: BLE001 - a damaged cache entry is made again, whatever broke
        warnings.warn(f"the converted model in {path} does not load ({type(err).__name__}: {err}); "
                      "converting the GGUF file again", stacklevel=3)
        shutil.rmtree(path, ignore_errors=True)
        return None
    return model, tokenizer


def convert(gguf: str | os.PathLike, model: torch.nn.Module, tokenizer) -> Path | None:
    """Save a model just read from ``gguf`` (float32, as dequantized) and its tokenizer as its cache folder,
    atomically; None where the cache is off or cannot be written (the load goes on without it)."""
    root = cache_dir()
    if root is None or next(model.parameters()).dtype != torch.float32:
        return None
    gguf = Path(gguf)
    path, expected = _entry(root, gguf)
    architectures = getattr(model.config, "architectures", None)  # before save_pretrained fills them in
    try:
        with atomic_dir(path) as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            files = sorted(p.name for p in tmp.iterdir())
            write_json_atomic(tmp / RECORD, {**expected, "source": gguf.name, "files": files,
                                             "architectures": architectures})
    except OSError as err:
        model.config.architectures = architectures
        warnings.warn(f"cannot keep the converted model under {root} ({err}); set SPAP_CACHE_DIR to a writable "
                      "folder, or SPAP_CACHE_DIR=off", stacklevel=3)
        return None
    model.config.architectures = architectures
    return path
