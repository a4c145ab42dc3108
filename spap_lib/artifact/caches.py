"""What one run hands to the next: the calibration windows and the dense perplexity (``01_calibrate``), and the
dense statistics a grid's jobs share (``jobs``), each reused only when its key matches: the model's content
(``keys.source_key``: weights, config, tokenizer files), the tokenizer built from it (``keys.tokenizer_digest``),
the data's checksum, the sizes and seed or the evaluation protocol, and the code that computed it. A cache that is
damaged (cut short, not spap's) or of another key is computed again, never reused."""
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


def calibration_key(loaded: Loaded, nsamples: int, seqlen: int, seed: int) -> dict:
    return {"model": keys.source_key(loaded.source), "tokenizer": keys.tokenizer_digest(loaded.tokenizer),
            "data": calibration_text().source, "nsamples": nsamples, "seqlen": seqlen, "seed": seed,
            "code": keys.code_digest(data_module)}


def _unusable(path: Path, err: Exception) -> None:
    warnings.warn(f"{path} is unreadable ({type(err).__name__}: {str(err)[:120]}); computing it again", stacklevel=3)


def _tensors_digest(*tensors: torch.Tensor) -> str:
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(t.contiguous().numpy().tobytes())
    return digest.hexdigest()


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
    key = calibration_key(loaded, nsamples, seqlen, seed)
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
    key = {"model": keys.source_key(loaded.source), "tokenizer": keys.tokenizer_digest(loaded.tokenizer),
           "data": wikitext("test").source, "eval_seqlen": eval_seqlen, "eval_windows": eval_windows,
           "code": keys.code_digest(perplexity_module)}
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


def dense_pass_key(loaded: Loaded, calib: Calibration, name: str, batch_size: int, chunk: int) -> dict:
    """What a dense pass of the grid depends on: the model's content, the windows, which pass (``Grid.dense_pass``'s
    key), the batching, and the code that computes it."""
    from spap_lib.numerics import stats as stats_module
    from spap_lib.pipeline import sequential

    return {"model": keys.source_key(loaded.source), "windows": calib.describe()["sha256"], "pass": name,
            "batch_size": batch_size, "chunk": chunk, "code": keys.code_digest(sequential, stats_module)}


def _stats_digest(rows: list[dict]) -> str:
    tensors = [r[k] for r in rows for k in ("z_sum", "z_sq") if r[k] is not None]
    scalars = [[r["N"], r["angular"], r["curve"]] for r in rows]
    return _tensors_digest(*tensors) + hashlib.sha256(json.dumps(scalars).encode()).hexdigest()


def save_dense_pass(path: str | Path, stats: list, seconds: float, key: dict) -> None:
    """A grid's dense pass (a ``ChannelStats`` per layer) and its seconds, with its key and checksum."""
    def host(t):
        return t.cpu() if t is not None else None

    rows = [{"N": s.N, "z_sum": host(s.z_sum), "z_sq": host(s.z_sq), "angular": s.angular,
             "curve": [list(p) for p in s.curve] if s.curve is not None else None} for s in stats]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as tmp:
        torch.save({"key": json.dumps(key, sort_keys=True), "layers": rows, "seconds": seconds,
                    "checksum": _stats_digest(rows)}, tmp)


def load_dense_pass(path: str | Path, key: dict, device) -> tuple[list, float] | None:
    """The dense pass saved under ``key`` (its tensors on ``device``) and its seconds; ``None`` when there is none,
    it is of another key, or it does not match its checksum (then it is computed again)."""
    from spap_lib.numerics.stats import ChannelStats

    path = Path(path)
    if not path.is_file():
        return None
    try:
        blob = torch.load(path, weights_only=True)
        if blob.get("key") != json.dumps(key, sort_keys=True):
            return None
        if blob.get("checksum") != _stats_digest(blob["layers"]):
            raise ValueError("the statistics do not match their checksum")
        def placed(t):
            return t.to(device) if t is not None else None

        stats = [ChannelStats(r["N"], placed(r["z_sum"]), placed(r["z_sq"]), r["angular"],
                              [tuple(p) for p in r["curve"]] if r["curve"] is not None else None)
                 for r in blob["layers"]]
        return stats, float(blob["seconds"])
    except Exception as err:  # noqa: BLE001 - whatever is wrong with the file, it is not this pass
        _unusable(path, err)
        return None
