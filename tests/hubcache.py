"""A Hugging Face hub cache laid out the way huggingface_hub writes one (``HF_HOME/hub``), built from local files:
``models--org--name/blobs/<hash>`` holding the bytes, ``snapshots/<commit>/<path>`` relative symlinks to them,
``refs/main`` naming the commit; sharded safetensors with their index; a dataset repo of parquet files."""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

import torch


def add_repo(cache: Path, repo_id: str, files: dict[str, Path], repo_type: str = "model") -> Path:
    """``files`` ({path in the repo: local file}) as one commit of ``repo_id`` in ``cache``; its snapshot folder."""
    root = Path(cache) / f"{repo_type}s--{repo_id.replace('/', '--')}"
    commit = hashlib.sha1(repo_id.encode() + b"".join(sorted(p.encode() for p in files))).hexdigest()
    snapshot = root / "snapshots" / commit
    for name, local in files.items():
        data = Path(local).read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    return snapshot


def add_model(cache: Path, repo_id: str, model, tokenizer, dtype: torch.dtype, max_shard_size: str = "40KB") -> Path:
    """``model`` saved in ``dtype`` as the hub holds it (safetensors shards and their index, config, tokenizer)."""
    with tempfile.TemporaryDirectory() as tmp:
        model.to(dtype).save_pretrained(tmp, max_shard_size=max_shard_size)
        tokenizer.save_pretrained(tmp)
        files = {str(p.relative_to(tmp)): p for p in Path(tmp).rglob("*") if p.is_file()}
        return add_repo(cache, repo_id, files)


def add_wikitext(cache: Path, data_dir: Path, config: str = "wikitext-2-raw-v1", test_rows: int | None = None) -> Path:
    """WikiText-2 raw as the hub's ``Salesforce/wikitext`` dataset repo holds it: one parquet file per split, a
    ``text`` column of the split's rows (``test_rows``: the test split's first rows only)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from spap_lib.evaluation.data import SPLIT_FILES, read_raw

    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for split, name in SPLIT_FILES.items():
            if not (Path(data_dir) / config / name).is_file():
                continue  # a data directory without the train split (calibration then reads validation)
            path = Path(tmp) / f"{split}.parquet"
            rows = read_raw(Path(data_dir) / config / name)
            pq.write_table(pa.table({"text": rows[:test_rows] if split == "test" else rows}), path)
            files[f"{config}/{split}-00000-of-00001.parquet"] = path
        return add_repo(cache, "Salesforce/wikitext", files, repo_type="dataset")
