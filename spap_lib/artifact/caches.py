"""What ``01_calibrate`` hands to the later notebooks: the calibration windows and the dense perplexity,
each reused only when its key matches: the model's content (``keys.source_key``: weights, config,
tokenizer), the data's checksum, the sizes and seed or the evaluation protocol, and the code that computed
it. A cache that is damaged (cut short, not spap's) or of another key is computed again, never reused."""
from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import torch

from spap_lib import keys
from spap_lib.artifact.manifest import manifest
from spap_lib.evaluation import data as data_module
from spap_lib.evaluation import perplexity as perplexity_module
from spap_lib.evaluation.data import Calibration, calibration_text, calibration_windows, wikitext
from spap_lib.evaluation.perplexity import perplexity
from spap_lib.files import atomic_file, write_json_atomic
from spap_lib.model.loading import Loaded


def _calibration_key(loaded: Loaded, nsamples: int, seqlen: int, seed: int) -> dict:
    return {"model": keys.source_key(loaded.source), "data": calibration_text().source, "nsamples": nsamples,
            "seqlen": seqlen, "seed": seed, "code": keys.code_digest(data_module)}


def _unusable(path: Path, err: Exception) -> None:
    warnings.warn(f"{path} is unreadable ({type(err).__name__}: {str(err)[:120]}); computing it again", stacklevel=3)


def _windows_digest(windows: torch.Tensor, starts) -> str:
    """The sha256 of the windows and their offsets: ``torch.load`` has no checksum of its own, and a flipped
    byte inside a tensor's storage loads as other tokens."""
    digest = hashlib.sha256(windows.to(torch.int64).contiguous().numpy().tobytes())
    digest.update(json.dumps([int(s) for s in starts]).encode())
    return digest.hexdigest()


def save_calibration(path: str | Path, calib: Calibration, key: dict) -> None:
    """Token windows + where they came from + their key and checksum (tensors and plain data only; loaded
    with weights_only)."""
    with atomic_file(path) as tmp:
        torch.save({"windows": calib.windows, "starts": calib.starts, "key": json.dumps(key, sort_keys=True),
                    **calib.describe(), "checksum": _windows_digest(calib.windows, calib.starts)}, tmp)


def load_calibration(path: str | Path, key: dict) -> Calibration | None:
    """The windows ``01_calibrate`` saved, if they were made under ``key``; otherwise ``None``."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        blob = torch.load(path, weights_only=True)
        if blob.get("key") != json.dumps(key, sort_keys=True):
            return None
        if blob.get("checksum") != _windows_digest(blob["windows"], blob["starts"]):
            raise ValueError("the windows do not match their checksum")
        calib = Calibration(blob["windows"], blob["starts"], blob["split"], blob["source"], blob["corpus_tokens"],
                            blob["seed"])
    except Exception as err:  # noqa: BLE001 - whatever is wrong with the file, it is not these windows
        _unusable(path, err)
        return None
    if tuple(calib.windows.shape) != (key["nsamples"], key["seqlen"]):
        _unusable(path, ValueError(f"windows of shape {tuple(calib.windows.shape)}"))
        return None
    return calib


def get_calibration(loaded: Loaded, nsamples: int, seqlen: int, seed: int,
                    cache: str | Path | None = None) -> Calibration:
    """The calibration windows, from ``cache`` when it holds this key's, else drawn (and saved to ``cache``)."""
    key = _calibration_key(loaded, nsamples, seqlen, seed)
    calib = load_calibration(cache, key) if cache else None
    if calib is None:
        calib = calibration_windows(loaded.tokenizer, nsamples, seqlen, seed)
        if cache:
            save_calibration(cache, calib, key)
    return calib


def dense_perplexity(loaded: Loaded, eval_seqlen: int, eval_windows: int | None,
                     cache: str | Path | None = None, progress: bool = True) -> dict:
    """Dense WikiText-2 perplexity, read from ``cache`` if an earlier run computed it under the same key.

    ``cache`` is the ``dense.json`` that ``01_calibrate`` writes (with parameter counts and versions).
    """
    key = {"model": keys.source_key(loaded.source), "data": wikitext("test").source, "eval_seqlen": eval_seqlen,
           "eval_windows": eval_windows, "code": keys.code_digest(perplexity_module)}
    path = Path(cache) if cache else None
    if path is not None and path.is_file():
        try:
            blob = json.loads(path.read_text())
            if blob.get("key") == key and isinstance(blob["perplexity"]["ppl"], float):
                return blob["perplexity"]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            _unusable(path, err)
    ppl = perplexity(loaded.model, loaded.tokenizer, eval_seqlen, eval_windows, progress=progress,
                     onloader=loaded.onloader)
    if path is not None:
        write_json_atomic(path, manifest(key=key, protocol={"model": loaded.source.name, "eval_seqlen": eval_seqlen,
                                                            "eval_windows": eval_windows},
                                         perplexity=ppl, params=loaded.param_counts()))
    return ppl
