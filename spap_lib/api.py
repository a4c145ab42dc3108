"""The few calls the notebooks make: calibrate, prune, save, count parameters.

Each takes explicit arguments and returns plain data (dicts), so the notebooks stay thin and the
same calls serve scripts and benchmarks.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from . import io
from .data import Calibration, calibration_windows
from .evaluate import perplexity
from .methods import get_method
from .models import Loaded
from .pipeline import plan_sparsity, prune_model


def param_counts(loaded: Loaded) -> dict:
    """Exact parameter counts: decoder layers only, and the whole model (tied weights once)."""
    return {"decoder": loaded.adapter.decoder_params(), "total": sum(p.numel() for p in loaded.model.parameters()),
            "mlp": loaded.adapter.mlp_params()}


def save_calibration(path: str | Path, calib: Calibration, model_name: str) -> None:
    """Token windows + where they came from (tensors and plain data only; loaded with weights_only)."""
    with io.atomic_file(path) as tmp:
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
    ppl = perplexity(loaded.model, loaded.tokenizer, eval_seqlen, eval_windows, progress=progress)
    if cache:
        io.write_json_atomic(cache, io.manifest(protocol=key, perplexity=ppl, params=param_counts(loaded)))
    return ppl


def prune(loaded: Loaded, calib: Calibration, method: str = "spap", sparsity: float = 0.2, *,
          hparams: dict | None = None, seed: int = 0, batch_size: int = 1, propagate: bool | None = None,
          progress: bool = True, inputs: tuple | None = None, stats: list | None = None,
          round_to: int | None = None) -> dict:
    """Prune ``loaded.model`` in place. Validates everything before any work is done.

    ``propagate=None`` uses the method's own setting; ``inputs``/``stats`` let a grid share the
    layer-0 inputs and dense statistics of one calibration set between runs (see ``grid.Grid``).
    """
    algo = get_method(method, **(hparams or {}))
    plan = plan_sparsity(loaded.adapter, sparsity, round_to)
    if algo.fits and calib.windows.numel() < plan.width:
        warnings.warn(
            f"only {calib.windows.numel()} calibration tokens for MLP width {plan.width}: the least-squares "
            f"steps are underdetermined and overfit the calibration set; use nsamples x seqlen >= {4 * plan.width}",
            stacklevel=2,
        )
    before = param_counts(loaded)
    torch.manual_seed(seed)
    run = prune_model(loaded.model, loaded.adapter, calib.windows, algo, plan, device=loaded.device,
                      batch_size=batch_size, seed=seed, propagate=propagate, progress=progress, inputs=inputs,
                      stats=stats)
    after = param_counts(loaded)
    widths = [len(k) for k in run["kept_channels"]]
    return {
        "method": method,
        "hparams": algo.hparams(),
        "propagate": run["propagate"],
        "seed": seed,
        "calibration": calib.describe(),
        "sparsity": {
            "requested": sparsity,
            "round_to": round_to,
            "counted_over": "parameters inside decoder layers (attention, MLP, norms); "
                            "not embeddings, final norm or LM head",
            "mlp_share_of_decoder": plan.mlp_share,
            "mlp_channels_removed": plan.n_remove * plan.layers,
            "mlp_width": {"dense": plan.width, "pruned": widths[0] if len(set(widths)) == 1 else widths},
            "mlp_channel_ratio": plan.mlp_ratio,
            "achieved_decoder": 1 - after["decoder"] / before["decoder"],
            "achieved_total": 1 - after["total"] / before["total"],
        },
        "params": {"dense": before, "pruned": after},
        "seconds": run["seconds"],
        "layers": run["layers"],
        "kept_channels": run["kept_channels"],
    }


def save(loaded: Loaded, report: dict, out_dir: str | Path, **extra) -> Path:
    """Atomically save the pruned model, tokenizer, manifest (report + versions + git) and the plan
    (``spap_plan.json``: kept dense channel indices per layer)."""
    fields = io.manifest(model=loaded.source.as_dict(), **{k: v for k, v in report.items() if k != "kept_channels"},
                         **extra)
    plan = {"model": loaded.source.as_dict(), "kept_channels": report["kept_channels"]}
    return io.save_pruned(loaded.model, loaded.tokenizer, out_dir, fields, extra_files={io.PLAN: plan})

