"""Saving a pruned model: nothing is installed unless its logits are finite and the written checkpoint
reloads, the way users will load it, to the same logits; then the folder is installed atomically."""
from __future__ import annotations

import json
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
from spap_lib.errors import CheckpointError
from spap_lib.files import write_json_atomic, write_text_atomic
from spap_lib.model.capture import streamed_logits
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


@torch.no_grad()
def check_reload(model, path: Path, sample: torch.Tensor, logits: torch.Tensor) -> dict:
    """Reload ``path`` the way users will (stock ``transformers`` for uniform widths, ``spap_lib.load``
    for per-layer widths) and compare its logits with the in-memory model's."""
    reloaded, how = load_saved(path, model.dtype)
    reloaded.to(sample.device).eval()
    diff = float((reloaded(input_ids=sample, use_cache=False).logits - logits).abs().max())
    return _reload_check(diff, model.dtype, how, sample)


@torch.no_grad()
def _streamed_sample_logits(model, onloader, sample: torch.Tensor) -> torch.Tensor:
    out = []
    streamed_logits(model, onloader, sample, lambda _i, _s, logits: out.append(logits))
    return out[0]


def check_reload_streamed(loaded: Loaded, path: Path, sample: torch.Tensor, logits: torch.Tensor) -> dict:
    """The reload check of an offloaded model, within its memory: the written checkpoint is opened with
    ``offload="disk"`` (config and tensor names as stock loading reads them; every tensor required)
    and its logits, computed layer by layer, compared with those of the model that was saved."""
    from spap_lib.model.loading import load as load_model

    dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[loaded.model.dtype]
    reloaded = load_model(str(path), device=str(loaded.device), dtype=dtype, offload="disk")
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
    return _reload_check(diff, loaded.model.dtype, "spap_lib.load(offload='disk')", sample)


def _reload_check(diff: float, dtype: torch.dtype, how: str, sample: torch.Tensor) -> dict:
    """The reload check's verdict: the reloaded logits within the dtype's tolerance of the saved model's
    (float32: 1e-4; half precision: 1e-2), else the checkpoint is not installed."""
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    if not diff <= tol:
        raise CheckpointError(f"the saved checkpoint does not reload to the same model (max |logit diff| {diff:.3g} "
                              f"> {tol}); it was not installed")
    return {"logits_finite": True, "reload_max_abs_diff": diff, "reloaded_with": how,
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
    fields = manifest(model=loaded.source.as_dict(), **{k: v for k, v in report.items() if k != "kept_channels"},
                         **extra)
    fmt = format_of_report(report)  # a registered layout's plan (a sliced stream's shapes), else kept channels
    plan = {"model": loaded.source.as_dict(),
            **({fmt.plan_key: report[fmt.plan_key]} if fmt else {"kept_channels": report["kept_channels"]})}
    protect = protected(loaded.source, **(protect or {}))
    check_out_dir(out_dir, overwrite=overwrite, protect=protect)  # before the sample pass
    if loaded.offload == "none":
        sample = _sample(loaded.model)
        logits = finite_logits(loaded.model, sample)  # before anything is written
        check, write = (lambda tmp: check_reload(loaded.model, tmp, sample, logits)), None
        if fmt is not None:
            def write(tmp):
                loaded.model.save_pretrained(tmp, safe_serialization=True)
                fmt.mark(tmp, report[fmt.plan_key])
    else:  # offloaded: the same checks, one layer at a time
        sample = _sample(loaded.model).cpu()
        logits = _streamed_sample_logits(loaded.model, loaded.onloader, sample)
        if not bool(torch.isfinite(logits).all()):
            raise CheckpointError(f"the pruned model's logits are not finite (activations overflow in "
                                  f"{loaded.model.dtype} or non-finite weights); it is not saved")
        check = lambda tmp: check_reload_streamed(loaded, tmp, sample, logits)  # noqa: E731
        write = (lambda tmp: write_checkpoint_weights(loaded.model, loaded.onloader, tmp)) \
            if loaded.offload == "disk" else None
    write = write or (lambda tmp: loaded.model.save_pretrained(tmp, safe_serialization=True))
    files = {PLAN: plan, CARD: card.render(fields)}  # the model card: README.md, the Hub's conventions
    return save_pruned(write, loaded.tokenizer, out_dir, fields, extra_files=files, overwrite=overwrite,
                       protect=protect, check=check)


def add_evaluation(folder: str | Path, evaluation: dict) -> None:
    """Record an evaluation of a saved checkpoint in its manifest and its model card (``spap eval``), each written
    atomically; a folder that is not a spap checkpoint is left alone."""
    folder = Path(folder)
    try:
        fields = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return
    fields["evaluations"] = [*fields.get("evaluations", []), evaluation]
    write_json_atomic(folder / MANIFEST, fields)
    write_text_atomic(folder / CARD, card.render(fields))
