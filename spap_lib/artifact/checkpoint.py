"""Saving a pruned model: nothing is installed unless its logits are finite and the written checkpoint
reloads, the way users will load it, to the same logits; then the folder is installed atomically."""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch

from spap_lib.artifact import card
from spap_lib.artifact.card import CARD
from spap_lib.artifact.manifest import (
    MANIFEST,
    PLAN,
    check_out_dir,
    manifest,
    read_checkpoint_manifest,
    save_pruned,
)
from spap_lib.errors import CheckpointError, option
from spap_lib.files import locked, records_lock, write_json_atomic, write_text_atomic
from spap_lib.keys import parts_key
from spap_lib.model.capture import streamed_logits
from spap_lib.model.dtypes import dtype_name, run_dtypes, saved_dtype
from spap_lib.model.formats import format_of_report
from spap_lib.model.loading import Loaded, context_length, load_saved
from spap_lib.model.offload import first_device, write_checkpoint_weights
from spap_lib.model.sources import ModelSource
from spap_lib.numerics.linalg import nonfinite_parameters


def protected(source: ModelSource, **more) -> dict:
    """What an out_dir may never replace: the source model's folder (local sources) and ``more``
    ({description: path}, e.g. the run folder); ``None`` entries are dropped."""
    local = Path(source.path) if source.kind in ("dir", "gguf") else None
    return {k: v for k, v in {"the source model": local, **more}.items() if v is not None}


def _sample(model, tokens: int = 32) -> torch.Tensor:
    """A fixed batch of token ids for the pre-save checks (any model, any tokenizer)."""
    vocab = model.get_input_embeddings().num_embeddings
    tokens = min(tokens, context_length(model.config) or tokens)
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (1, tokens), generator=gen).to(first_device(model))


@torch.no_grad()
def finite_logits(model, sample: torch.Tensor) -> torch.Tensor:
    """The model's logits on ``sample``; a model with NaN/Inf logits is refused, naming its bad weights."""
    logits = model(input_ids=sample, use_cache=False).logits
    if not bool(torch.isfinite(logits).all()):
        bad = nonfinite_parameters(model)
        cause = f"non-finite weights: {'; '.join(bad[:5])}" if bad else f"activations overflow in {model.dtype}"
        raise CheckpointError(f"the pruned model's logits are not finite ({cause}); it is not saved")
    return logits


@contextmanager
def parameters_in(model, dtype: torch.dtype):
    """The model's parameters cast to ``dtype`` while it is written, then back. Buffers are left alone: rotary
    tables stay float32, as ``from_pretrained`` keeps them, so the checkpoint reloads to the model that was checked."""
    cast = {p: p.dtype for p in model.parameters() if p.is_floating_point() and p.dtype != dtype}
    before = model.config.dtype
    for p in cast:
        p.data = p.data.to(dtype)
    try:
        yield
    finally:
        for p, working in cast.items():
            p.data = p.data.to(working)  # exact: round_weights left only values ``dtype`` holds
        model.config.dtype = before


@torch.no_grad()
def check_reload(model, path: Path, sample: torch.Tensor, logits: torch.Tensor, saved: torch.dtype) -> dict:
    """Reload ``path`` the way users will (stock ``transformers`` for uniform widths, ``spap_lib.load``
    for per-layer widths), in the dtype the model computed in, and compare its logits with the in-memory model's."""
    reloaded, how = load_saved(path, model.dtype)
    reloaded.to(sample.device).eval()
    diff = float((reloaded(input_ids=sample, use_cache=False).logits - logits).abs().max())
    return _reload_check(diff, model.dtype, saved, how, sample, logits)


@torch.no_grad()
def _streamed_sample_logits(model, onloader, sample: torch.Tensor) -> torch.Tensor:
    out = []
    streamed_logits(model, onloader, sample, lambda _i, _s, logits: out.append(logits))
    return out[0]


def check_reload_streamed(loaded: Loaded, path: Path, sample: torch.Tensor, logits: torch.Tensor,
                          saved: torch.dtype) -> dict:
    """The reload check of an offloaded model, within its memory: the written checkpoint is opened with
    ``offload="disk"`` (config and tensor names as stock loading reads them; every tensor required)
    and its logits, computed layer by layer, compared with those of the model that was saved."""
    from spap_lib.model.loading import load as load_model

    working = loaded.model.dtype
    reloaded = load_model(str(path), device=str(loaded.device), dtype=dtype_name(working), offload="disk")
    try:
        # every name, a tied head's too (some transformers versions write it, stock loading ignores it)
        used = {n for n, _ in reloaded.model.named_parameters(remove_duplicate=False)}
        unused = reloaded.onloader.store.names() - used
        if unused:
            raise CheckpointError(f"the saved checkpoint has tensors its config does not use ({sorted(unused)[:5]}); "
                                  "it was not installed")
        diff = float((_streamed_sample_logits(reloaded.model, reloaded.onloader, sample) - logits).abs().max())
    finally:
        reloaded.onloader.close()
    return _reload_check(diff, working, saved, "spap_lib.load(offload='disk')", sample, logits)


def reload_tolerance(working: torch.dtype, scale: float) -> float:
    """How far reloaded logits may be from the checked model's: the same weights in the same dtype differ only by
    the order of a few sums, which grows with the logits' magnitude ``scale`` (float32: 1e-5 of it, at least
    1e-4; half precision: two of the dtype's steps at that magnitude)."""
    if working == torch.float32:
        return max(1e-4, 1e-5 * scale)
    return 2 * torch.finfo(working).eps * max(1.0, scale)


def _reload_check(diff: float, working: torch.dtype, saved: torch.dtype, how: str, sample: torch.Tensor,
                  logits: torch.Tensor) -> dict:
    """The reload check's verdict: the reloaded logits within ``reload_tolerance`` of the saved model's, else the
    checkpoint is not installed and the refusal names what to do."""
    scale = float(logits.abs().max())
    tol = reload_tolerance(working, scale)
    if not diff <= tol:
        fix = (f"save it in the dtype it was computed in ({option('save_dtype', dtype_name(working))})"
               if saved != working else "check the disk it was written to (free space, another writer)")
        raise CheckpointError(
            f"the saved checkpoint does not reload to the same model: max |logit diff| {diff:.3g} > {tol:.3g}, the "
            f"tolerance for {dtype_name(working)} logits up to {scale:.3g}; it was not installed. To install it, "
            f"{fix}; a run given {option('resume_dir', 'DIR')} keeps its pruned layers there, so rerunning it does "
            "not prune again")
    return {"logits_finite": True, "reload_max_abs_diff": diff, "reload_tolerance": tol, "reloaded_with": how,
            "reloaded_dtype": dtype_name(working), "saved_dtype": dtype_name(saved),
            "sample_tokens": int(sample.numel())}


def prune_result(model: str, method: str, sparsity: float, out_dir: str | Path, report: dict) -> dict:
    """What a prune run records (02's ``prune_result.json``, the ``spap prune`` command's output): the
    request, where the saved checkpoint is and its reload check, and the report's measured parts."""
    checks = read_checkpoint_manifest(out_dir)["checks"]
    return {"model": model, "method": method, "sparsity": sparsity, "out_dir": str(out_dir),
            "reload_max_abs_diff": checks["reload_max_abs_diff"],
            **{k: report[k] for k in ("seconds", "offload", "memory", "calibration", "sparsity", "params",
                                      "perplexity")}}


def save(loaded: Loaded, report: dict, out_dir: str | Path, *, overwrite: bool = False,
         protect: dict | None = None, **extra) -> Path:
    """Save the pruned model, tokenizer, manifest (report + versions + git) and the plan
    (``spap_plan.json``: kept dense channel indices per layer).

    Nothing reaches ``out_dir`` unless the model's logits are finite and the written checkpoint
    reloads to the same logits (recorded in the manifest under ``checks``); then it is installed
    atomically. ``out_dir`` must be new, empty or (``overwrite``) a previous spap checkpoint; it may
    not be the source model or any path in ``protect`` ({description: path}).
    """
    if saved_dtype(report) is None:  # a report of sl.prune alone: saved in the source's dtype, as `spap prune` does
        dtypes = run_dtypes("auto", loaded.source, loaded.model.config, loaded.model.dtype)
        report = {**report, "dtype": dtypes.as_dict()}
    fields = manifest(model=loaded.source.as_dict(), **{k: v for k, v in report.items() if k != "kept_channels"},
                         card=card.provenance(loaded.source.as_dict()), **extra)
    fmt = format_of_report(report)  # a registered layout's plan (a sliced stream's shapes), else kept channels
    plan = {"model": loaded.source.as_dict(),
            **({fmt.plan_key: report[fmt.plan_key]} if fmt else {"kept_channels": report["kept_channels"]})}
    protect = protected(loaded.source, **(protect or {}))
    check_out_dir(out_dir, overwrite=overwrite, protect=protect)  # before the sample pass
    working, saved = loaded.model.dtype, saved_dtype(report)
    loaded.onloader.round_weights(saved)  # the model in memory becomes the one the checkpoint holds
    if loaded.offload == "none":
        sample = _sample(loaded.model)
        logits = finite_logits(loaded.model, sample)  # before anything is written
        check = lambda tmp: check_reload(loaded.model, tmp, sample, logits, saved)  # noqa: E731
    else:  # offloaded: the same checks, one layer at a time
        sample = _sample(loaded.model).cpu()
        logits = _streamed_sample_logits(loaded.model, loaded.onloader, sample)
        if not bool(torch.isfinite(logits).all()):
            raise CheckpointError(f"the pruned model's logits are not finite (activations overflow in "
                                  f"{working} or non-finite weights); it is not saved")
        check = lambda tmp: check_reload_streamed(loaded, tmp, sample, logits, saved)  # noqa: E731

    def write(tmp):
        if loaded.offload == "disk":
            return write_checkpoint_weights(loaded.model, loaded.onloader, tmp, saved)
        with parameters_in(loaded.model, saved):
            loaded.model.save_pretrained(tmp, safe_serialization=True)
        if fmt is not None:
            fmt.mark(tmp, report[fmt.plan_key])
    files = {PLAN: plan, CARD: card.render(fields)}  # the model card: README.md, the Hub's conventions
    return save_pruned(write, loaded.tokenizer, out_dir, fields, extra_files=files, overwrite=overwrite,
                       protect=protect, check=check)


# What a checkpoint's manifest records about where and how it was written, rather than what was pruned: a copy
# written from it (a heal) records its own.
_WRITTEN = ("created", "git_revision", "versions", "host", "checks", "spap_checkpoint", "card", "command",
            "evaluations", "model")


def prune_record(folder: str | Path) -> dict | None:
    """A saved checkpoint's prune as ``save`` takes a report: its manifest's record of the prune (method, sparsity,
    calibration, dtypes, perplexity ...) and its plan's kept channels or layout; None for a folder spap did not
    write."""
    fields = read_checkpoint_manifest(folder) if Path(folder).is_dir() else None
    if fields is None:
        return None
    plan = json.loads((Path(folder) / PLAN).read_text())
    return {**{k: v for k, v in fields.items() if k not in _WRITTEN}, **{k: v for k, v in plan.items() if k != "model"}}


def checkpoint_digests(folder: str | Path) -> dict | None:
    """The digests of a spap checkpoint's files as its manifest lists them (what decides its model), else None."""
    fields = read_checkpoint_manifest(folder) or {}
    return (fields.get("spap_checkpoint") or {}).get("digests")


def add_evaluation(folder: str | Path, evaluation: dict, digests: dict | None) -> str | None:
    """Record an evaluation of a saved checkpoint in its manifest and merge it into its model card (``spap eval``),
    under the lock its replacement also takes, and only where the folder still holds the model that was evaluated:
    ``digests``, its files' as read before it was loaded. Returns why nothing was recorded, or None; a folder that
    is not a spap checkpoint is left alone."""
    folder = Path(folder)
    try:
        with locked(records_lock(folder)):
            fields = read_checkpoint_manifest(folder)
            if fields is None:
                return None
            if checkpoint_digests(folder) != digests:
                return (f"{folder} was replaced while it was evaluated, so the result belongs to the model it held "
                        "before; evaluate it again to record the new one")
            model = parts_key(digests) if digests else None  # as keys.source_key names the folder's model
            fields["evaluations"] = [*fields.get("evaluations", []), {**evaluation, "model": model}]
            write_json_atomic(folder / MANIFEST, fields)
            user_card = (folder / CARD).read_text() if (folder / CARD).is_file() else ""
            write_text_atomic(folder / CARD, card.merge(user_card, fields))
    except OSError as err:
        return f"cannot write {folder}'s records ({err.strerror or err})"
    return None
