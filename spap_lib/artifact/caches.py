"""What ``01_calibrate`` hands to the later notebooks: the calibration windows and the dense perplexity,
each reused only when its request matches (model, sizes, seed; the evaluation protocol)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from spap_lib.artifact.manifest import manifest
from spap_lib.evaluation.data import Calibration, calibration_windows
from spap_lib.evaluation.perplexity import perplexity
from spap_lib.files import atomic_file, write_json_atomic
from spap_lib.model.loading import Loaded


def save_calibration(path: str | Path, calib: Calibration, model_name: str) -> None:
    """Token windows + where they came from (tensors and plain data only; loaded with weights_only)."""
    with atomic_file(path) as tmp:
        torch.save({"windows": calib.windows, "starts": calib.starts, "model": model_name, **calib.describe()}, tmp)


def load_calibration(path: str | Path, model_name: str, nsamples: int, seqlen: int, seed: int) -> Calibration | None:
    """The windows ``01_calibrate`` saved, if they match the request; otherwise ``None``."""
    path = Path(path)
    if not path.is_file():
        return None
    blob = torch.load(path, weights_only=True)
    if (blob["model"], blob["nsamples"], blob["seqlen"], blob["seed"]) != (model_name, nsamples, seqlen, seed):
        return None
    return Calibration(blob["windows"], blob["starts"], blob["split"], blob["source"], blob["corpus_tokens"],
                       blob["seed"])


def get_calibration(loaded: Loaded, model_name: str, nsamples: int, seqlen: int, seed: int,
                    cache: str | Path | None = None) -> Calibration:
    calib = load_calibration(cache, model_name, nsamples, seqlen, seed) if cache else None
    return calib or calibration_windows(loaded.tokenizer, nsamples, seqlen, seed)


def dense_perplexity(loaded: Loaded, model_name: str, eval_seqlen: int, eval_windows: int | None,
                     cache: str | Path | None = None, progress: bool = True) -> dict:
    """Dense WikiText-2 perplexity, read from ``cache`` if an earlier run used the same protocol.

    ``cache`` is the ``dense.json`` that ``01_calibrate`` writes (with parameter counts and versions).
    """
    key = {"model": model_name, "eval_seqlen": eval_seqlen, "eval_windows": eval_windows}
    if cache and Path(cache).is_file():
        blob = json.loads(Path(cache).read_text())
        if blob.get("protocol") == key:
            return blob["perplexity"]
    ppl = perplexity(loaded.model, loaded.tokenizer, eval_seqlen, eval_windows, progress=progress,
                     onloader=loaded.onloader)
    if cache:
        write_json_atomic(cache, manifest(protocol=key, perplexity=ppl, params=loaded.param_counts()))
    return ppl
