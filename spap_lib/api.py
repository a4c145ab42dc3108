"""The few calls the notebooks make: check, calibrate, prune, save, count parameters.

Each takes explicit arguments and returns plain data (dicts), so the notebooks stay thin and the
same calls serve scripts and benchmarks. ``check_run`` refuses bad input before any weight is read;
``save`` installs a checkpoint only after its logits are finite and its reload matches.
"""
from __future__ import annotations

import copy
import json
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from . import io, resume
from .adapters import get_adapter
from .capture import streamed_logits
from .checks import Spec, check_sparsity, check_values, fits_context
from .data import Calibration, calibration_windows
from .errors import CheckpointError, OutputError, ParameterError, current_surface, option
from .evaluate import perplexity
from .linalg import NumericalError, nonfinite_parameters, resolve_precision
from .memory import measured
from .methods import Method, get_method
from .models import Loaded, ModelSource, context_length, pick_device, read_config, resolve
from .onload import SafetensorsStore, check_offload, remove_dead_spills, write_checkpoint_weights
from .pipeline import SparsityPlan, plan_sparsity, prune_model
from .plan import Plan, available_host_gb, local_device, plan, size


@dataclass
class RunCheck:
    """What ``check_run`` established before any weight was read."""

    source: ModelSource
    config: object
    context: int | None
    method: Method | None = None
    plan: SparsityPlan | None = None
    out_state: str | None = None  # "new", "empty" or "checkpoint" (replaced: overwrite=True)
    memory_time: Plan | None = None  # the plan's peak memory and time (``spap_lib.plan``)
    offload: str = "none"  # resolved: "auto" becomes the fastest mode the plan says fits

    def summary(self) -> str:
        lines = [f"model {self.source.name}: {self.config.model_type} from {self.source.kind} {self.source.path}, "
                 f"context {self.context or 'unknown'} tokens"]
        if self.method is not None:
            lines.append(f"method {self.method.name}: {self.method.hparams()}")
        if self.plan is not None:
            p = self.plan
            lines.append(f"remove {p.n_remove} of {p.width} MLP channels per layer ({p.mlp_ratio:.1%} of channels; "
                         f"MLP = {p.mlp_share:.1%} of decoder params)")
        if self.out_state is not None:
            replaced = " (will be replaced)" if self.out_state == "checkpoint" else ""
            lines.append(f"out_dir: {self.out_state}{replaced}")
        if self.memory_time is not None:
            lines.append(self.memory_time.table())
            hours = self.memory_time.total_seconds / 3600
            if self.memory_time.device.startswith("cpu") and hours > 0.5:
                lines.append(f"On this CPU the plan estimates {hours:.1f} h (the paper's settings are for a GPU). "
                             "The setting measured on a 2-core CPU (128 x 512 calibration, 40 test windows of 512; "
                             "about 12 min for SmolLM2-135M): papermill -f configs/offline.yaml, or spap prune "
                             "--nsamples 128 --seqlen 512 --eval-seqlen 512 --eval-windows 40.")
        return "\n".join(lines)


def _protected(source: ModelSource, **more) -> dict:
    """What an out_dir may never replace: the source model's folder (local sources) and ``more``
    ({description: path}, e.g. the run folder); ``None`` entries are dropped."""
    local = Path(source.path) if source.kind in ("dir", "gguf") else None
    return {k: v for k, v in {"the source model": local, **more}.items() if v is not None}


def check_run(model: str, *, method: str | None = None, sparsity: float | None = None, hparams: dict | None = None,
              nsamples: int | None = None, seqlen: int | None = None, eval_seqlen: int | None = None,
              eval_windows: int | None = None, seed: int = 0, round_to: int | None = None,
              propagate: bool | None = None, device: str = "auto", out_dir: str | Path | None = None,
              run_dir: str | Path | None = None, overwrite: bool = False, offload: str = "auto",
              spill_dir: str | Path | None = None, resume_dir: str | Path | None = None) -> RunCheck:
    """Check every parameter of a run before any weight is read; raise with the fix, else say what will run.

    Reads only the model's config (GGUF: its metadata): the architecture, the context length that
    ``seqlen``/``eval_seqlen`` must fit, and (on the meta device, no memory) the sparsity plan and
    the method's architecture checks. ``out_dir`` must be new, empty or (``overwrite``) a previous
    spap checkpoint, and neither the source model nor ``run_dir``. ``offload`` (``spap_lib.onload``)
    ``auto`` becomes the fastest of none, cpu, disk that the plan says fits this device, the host's
    available memory and the free space under ``spill_dir`` (disk); without a plan (no method or
    calibration size), ``none``. The disk under ``out_dir`` must hold the pruned checkpoint, and a
    ``resume_dir`` must be new, empty, or hold this run's finished layers. Spill folders that dead runs
    left under ``spill_dir`` are removed.
    """
    check_values(("nsamples", nsamples, Spec(int, ge=1, optional=True)),
                 ("seqlen", seqlen, Spec(int, ge=2, optional=True)),
                 ("eval_seqlen", eval_seqlen, Spec(int, ge=2, optional=True)),
                 ("eval_windows", eval_windows, Spec(int, ge=1, optional=True)),
                 ("round_to", round_to, Spec(int, ge=1, optional=True)),
                 ("seed", seed, Spec(int, ge=0)),
                 ("propagate", propagate, Spec(bool, optional=True)),
                 ("overwrite", overwrite, Spec(bool)),
                 ("hparams", hparams, Spec(dict, optional=True)))
    check_offload(offload)
    algo = get_method(method, **(hparams or {})) if method is not None else None
    pick_device(device)
    spill_root = _existing(Path(spill_dir) if spill_dir else Path(tempfile.gettempdir()))
    remove_dead_spills(spill_root)
    if resume_dir is not None:
        resume.check_folder(resume_dir)  # a file, a foreign folder or state.json: before reading the model
    source = resolve(model)  # the config and, for a local folder, the weight files' headers
    out_state = None
    if out_dir is not None:  # an unusable name, a foreign folder, the source itself: before the plan
        out_state = io.check_out_dir(out_dir, overwrite=overwrite,
                                     protect=_protected(source, **{"the run folder": run_dir}))
    if offload == "disk" and source.kind == "dir":
        SafetensorsStore(source.path)  # refuses pickle (.bin) checkpoints, naming the offloads that still work
    config = read_config(source)
    if sparsity is not None and getattr(config, "spap_mlp_widths", None):
        raise ParameterError(f"{model} is already pruned with per-layer widths; prune a dense model")
    if sparsity is not None and getattr(config, "spap_slicing", None):
        raise ParameterError(f"{model} is a SliceGPT checkpoint (sliced residual stream); prune a dense model")
    context = context_length(config)
    fits_context("seqlen", seqlen, context, model)
    fits_context("eval_seqlen", eval_seqlen, context, model)
    check = RunCheck(source, config, context, algo)
    if sparsity is not None:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):  # shapes only: no memory, no weights; a copy, since methods may edit it
            adapter = get_adapter(AutoModelForCausalLM.from_config(copy.deepcopy(config)))
        whole = algo is not None and algo.whole_model
        if whole:  # SliceGPT: its own sparsity (a slicing fraction), resident models, no memory plan yet
            check_sparsity(sparsity)
            if offload not in ("auto", "none"):
                raise ParameterError(f"method {algo.name!r} needs the model resident: offload 'none' or 'auto', "
                                     f"not {offload!r}")
            offload = "none"
        else:
            check.plan = plan_sparsity(adapter, sparsity, round_to)
            if resume_dir is not None and algo is not None:
                resume.check_folder(resume_dir, {"model": source.name, "method": method, "hparams": algo.hparams(),
                                                 "n_remove": check.plan.n_remove, "seed": seed, "round_to": round_to,
                                                 "propagate": propagate})
        if algo is not None:
            algo.prepare(adapter)  # e.g. FLAP's bias slot, SliceGPT's architectures
        if algo is not None and nsamples and seqlen and not whole and sparsity > 0:
            dev = pick_device(device)
            row, memory_gb = local_device(dev)
            check.memory_time = p = plan(
                model, method=method, hparams=hparams, sparsity=sparsity, nsamples=nsamples, seqlen=seqlen,
                eval_seqlen=eval_seqlen or seqlen, eval_windows=eval_windows, device=row, device_memory_gb=memory_gb,
                host_memory_gb=available_host_gb() if dev.type != "cpu" else None, offload=offload,
                disk_free_gb=shutil.disk_usage(spill_root).free / 2**30, config=config)
            if not p.fits:
                raise ParameterError(
                    f"this run does not fit with {option('offload', p.offload)}: the plan needs "
                    f"{size(p.peak_device_gb)} on {p.device} ({_limit(p.device_memory_gb)}), {size(p.peak_host_gb)} "
                    f"of host memory ({_limit(p.host_memory_gb)})"
                    + (f", {size(p.disk_gb)} of disk under {spill_root} ({_limit(p.disk_free_gb)})"
                       if p.offload == "disk" else "")
                    + ". Use " + (f"{option('offload', 'disk')} (weights read layer by layer), " if p.offload != "disk"
                                  else f"{_spill_hint()}, ")
                    + "fewer calibration tokens (nsamples x seqlen), hparams {'precision': 'float32'}, or a larger "
                    f"device.\n{p.table()}")
            check.offload = p.offload
            if out_dir is not None:
                _check_space(out_dir, p.checkpoint_gb)
    if offload != "auto":
        check.offload = offload
    check.out_state = out_state
    return check


def _limit(gb: float | None) -> str:
    return f"{size(gb)} available" if gb is not None else "not checked"


def _existing(path: Path) -> Path:
    """``path`` or its nearest existing ancestor (where a new folder will be made)."""
    path = path.expanduser().absolute()
    while not path.exists():
        path = path.parent
    return path


def _spill_hint() -> str:
    """Where the caller moves the spill folder (the CLI makes it beside --out, 02 in its run_dir)."""
    return {"cli": "an --out on a larger disk (the spill folder is made beside it)",
            "papermill": "-p run_dir on a larger disk (the spill folder is made there)"}.get(
        current_surface(), "a spill_dir on a larger disk")


def _check_space(out_dir: str | Path, need_gb: float) -> None:
    """The pruned checkpoint must fit under ``out_dir`` (found out before the prune, not after it)."""
    where = _existing(Path(out_dir))
    free = shutil.disk_usage(where).free / 2**30
    if free < need_gb:
        raise OutputError(f"the pruned checkpoint needs about {size(need_gb)} and {where} has {size(free)} free: "
                          f"free some space or choose {option('out', '<a folder on a larger disk>')}")


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
    ppl = perplexity(loaded.model, loaded.tokenizer, eval_seqlen, eval_windows, progress=progress,
                     onloader=loaded.onloader)
    if cache:
        io.write_json_atomic(cache, io.manifest(protocol=key, perplexity=ppl, params=param_counts(loaded)))
    return ppl


def prune(loaded: Loaded, calib: Calibration, method: str = "spap", sparsity: float = 0.2, *,
          hparams: dict | None = None, seed: int = 0, batch_size: int = 1, propagate: bool | None = None,
          progress: bool = True, inputs: tuple | None = None, stats: list | None = None,
          round_to: int | None = None, chunk: int = 8192, resume_dir: str | Path | None = None,
          clear_resume: bool = True) -> dict:
    """Prune ``loaded.model`` in place. Validates everything before any work is done.

    ``propagate=None`` uses the method's own setting; ``inputs``/``stats`` let a grid share the
    layer-0 inputs and dense statistics of one calibration set between runs (see ``grid.Grid``).
    ``chunk``: tokens per pass of the Gram and error sums (memory, not results: the plan counts
    ``chunk·(n+2d)·4`` bytes for it). ``resume_dir``: every finished layer is saved there, and a run
    interrupted before the last layer resumes after the last saved one (``spap_lib.resume``); it serves
    the layer-by-layer prunes (SPAP, its ablations, FASP): the one-pass score methods and SliceGPT
    are minutes where SPAP is hours, and start over. ``clear_resume=False`` keeps the finished layers
    there (the grid clears them once the cell's rows are written).
    """
    check_values(("hparams", hparams, Spec(dict, optional=True)), ("seed", seed, Spec(int, ge=0)),
                 ("batch_size", batch_size, Spec(int, ge=1)), ("propagate", propagate, Spec(bool, optional=True)),
                 ("chunk", chunk, Spec(int, ge=1)))
    algo = get_method(method, **(hparams or {}))
    work = check_sparsity(sparsity) > 0  # sparsity 0: the dense model unchanged, whatever the method
    if work and algo.whole_model:
        given = [k for k, v in (("round_to", round_to), ("propagate", propagate), ("resume_dir", resume_dir))
                 if v is not None]
        if given:
            raise ParameterError(f"method {method!r} does not take {', '.join(given)} (it prunes the whole model at "
                                 f"once; its kept dimension's multiple is its own hyperparameter round_to)")
        return _prune_whole_model(loaded, calib, algo, sparsity, seed=seed, batch_size=batch_size, progress=progress)
    plan = plan_sparsity(loaded.adapter, sparsity, round_to)
    _check_prunable(loaded, calib)
    if work and algo.fits and calib.windows.numel() < plan.width:
        warnings.warn(
            f"only {calib.windows.numel()} calibration tokens for MLP width {plan.width}: the least-squares "
            f"steps are underdetermined and overfit the calibration set; use nsamples x seqlen >= {4 * plan.width}",
            stacklevel=2,
        )
    before = param_counts(loaded)
    checkpoint = None
    if resume_dir is not None and work:
        from .resume import LayerCheckpoint, code_hash

        checkpoint = LayerCheckpoint(resume_dir, {
            "model": loaded.source.name, "method": method, "hparams": algo.hparams(), "n_remove": plan.n_remove,
            "propagate": propagate, "calibration": calib.describe(), "seed": seed, "batch_size": batch_size,
            "device": loaded.device.type, "dtype": str(loaded.model.dtype), "round_to": round_to,
            "code": code_hash(type(algo))}, clear_when_done=clear_resume)
    torch.manual_seed(seed)
    with measured(loaded.device) as memory:
        run = prune_model(loaded.model, loaded.adapter, calib.windows, algo, plan, device=loaded.device,
                          onloader=loaded.onloader, batch_size=batch_size, chunk=chunk, seed=seed, propagate=propagate,
                          progress=progress, inputs=inputs, stats=stats, checkpoint=checkpoint) if work else \
            {"propagate": algo.propagates if propagate is None else propagate, "seconds": 0.0, "resumed_at_layer": 0,
             "layers": [], "kept_channels": [list(range(plan.width))] * plan.layers}
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
        "seconds": run["seconds"],  # of this run: a resumed one did not redo the first layers
        "resumed_at_layer": run["resumed_at_layer"],
        "offload": loaded.offload,
        "precision": resolve_precision(algo.precision, loaded.device),  # "auto" resolved for this device
        "memory": memory,
        "layers": run["layers"],
        "kept_channels": run["kept_channels"],
    }


def _check_prunable(loaded: Loaded, calib: Calibration) -> None:
    fits_context("seqlen", calib.windows.shape[1], context_length(loaded.model.config))
    bad = nonfinite_parameters(loaded.model)
    if bad:
        raise NumericalError(f"the model's weights are not finite ({'; '.join(bad[:5])}): the checkpoint is "
                             "damaged; spap cannot prune it. Reload or re-download the model.")


def _prune_whole_model(loaded: Loaded, calib: Calibration, algo: Method, sparsity: float, *, seed: int,
                       batch_size: int, progress: bool) -> dict:
    """A whole-model method (SliceGPT): its own sparsity definition, the parameters actually removed
    counted from the real tensors, the same report keys as the MLP-channel methods."""
    check_sparsity(sparsity)
    if loaded.offload != "none":
        raise ParameterError(f"method {algo.name!r} needs the model resident (offload='none'), got "
                             f"offload={loaded.offload!r}")
    algo.prepare(loaded.adapter)
    _check_prunable(loaded, calib)
    before = param_counts(loaded)
    width = loaded.adapter.width(loaded.adapter.layers()[0])
    torch.manual_seed(seed)
    with measured(loaded.device) as memory:
        run = algo.prune_model(loaded, calib, sparsity, batch_size=batch_size, progress=progress)
    after = param_counts(loaded)
    return {
        "method": algo.name, "hparams": algo.hparams(), "propagate": True, "seed": seed,
        "calibration": calib.describe(),
        "sparsity": {
            "requested": sparsity,
            "definition": f"{algo.name}: fraction of the residual-stream dimension sliced "
                          f"({run['hidden_size']} -> {run['sliced_dim']})",
            "counted_over": "parameters inside decoder layers (attention, MLP, norms, shortcut matrices); "
                            "not embeddings, final norm or LM head",
            "mlp_width": {"dense": width, "pruned": width}, "mlp_channel_ratio": 0.0,
            "achieved_decoder": 1 - after["decoder"] / before["decoder"],
            "achieved_total": 1 - after["total"] / before["total"],
        },
        "params": {"dense": before, "pruned": after},
        "seconds": run["seconds"], "resumed_at_layer": 0,  # a whole-model method runs in one process (no resume)
        "offload": loaded.offload, "precision": "float64", "memory": memory,
        "layers": run["layers"], "slicing": run["plan"],
    }


def _sample(model, tokens: int = 32) -> torch.Tensor:
    """A fixed batch of token ids for the pre-save checks (any model, any tokenizer)."""
    vocab = model.get_input_embeddings().num_embeddings
    tokens = min(tokens, context_length(model.config) or tokens)
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (1, tokens), generator=gen).to(next(model.parameters()).device)


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
    from transformers import AutoModelForCausalLM

    from .models import load_nonuniform
    from .slicing import load_sliced

    config = json.loads((path / "config.json").read_text())
    if "spap_slicing" in config:
        reloaded, how = load_sliced(path, model.dtype), "spap_lib.load"
    elif "spap_mlp_widths" in config:
        reloaded, how = load_nonuniform(path, model.dtype), "spap_lib.load"
    else:
        reloaded, how = AutoModelForCausalLM.from_pretrained(path, dtype=model.dtype), "transformers"
    reloaded.to(sample.device).eval()
    diff = float((reloaded(input_ids=sample, use_cache=False).logits - logits).abs().max())
    return _reload_check(diff, model.dtype, how, sample)


@torch.no_grad()
def _streamed_sample_logits(model, onloader, sample: torch.Tensor) -> torch.Tensor:
    out = []
    streamed_logits(model, onloader, sample, lambda _i, logits: out.append(logits))
    return out[0]


def check_reload_streamed(loaded: Loaded, path: Path, sample: torch.Tensor, logits: torch.Tensor) -> dict:
    """The reload check of an offloaded model, within its memory: the written checkpoint is opened with
    ``offload="disk"`` (config and tensor names as stock loading reads them; every tensor required)
    and its logits, computed layer by layer, compared with those of the model that was saved."""
    from .models import load as load_model

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
    checks = io.read_checkpoint_manifest(out_dir)["checks"]
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
    fields = io.manifest(model=loaded.source.as_dict(), **{k: v for k, v in report.items() if k != "kept_channels"},
                         **extra)
    sliced = "slicing" in report  # a whole-model method's plan (SliceGPT): the shapes, not kept channels
    plan = {"model": loaded.source.as_dict(),
            **({"slicing": report["slicing"]} if sliced else {"kept_channels": report["kept_channels"]})}
    protect = _protected(loaded.source, **(protect or {}))
    io.check_out_dir(out_dir, overwrite=overwrite, protect=protect)  # before the sample pass
    if loaded.offload == "none":
        sample = _sample(loaded.model)
        logits = finite_logits(loaded.model, sample)  # before anything is written
        check, write = (lambda tmp: check_reload(loaded.model, tmp, sample, logits)), None
        if sliced:
            from .slicing import mark_sliced

            def write(tmp):
                loaded.model.save_pretrained(tmp, safe_serialization=True)
                mark_sliced(tmp, report["slicing"])
    else:  # offloaded: the same checks, one layer at a time
        sample = _sample(loaded.model).cpu()
        logits = _streamed_sample_logits(loaded.model, loaded.onloader, sample)
        if not bool(torch.isfinite(logits).all()):
            raise CheckpointError(f"the pruned model's logits are not finite (activations overflow in "
                                  f"{loaded.model.dtype} or non-finite weights); it is not saved")
        check = lambda tmp: check_reload_streamed(loaded, tmp, sample, logits)  # noqa: E731
        write = (lambda tmp: write_checkpoint_weights(loaded.model, loaded.onloader, tmp)) \
            if loaded.offload == "disk" else None
    return io.save_pruned(loaded.model, loaded.tokenizer, out_dir, fields, extra_files={io.PLAN: plan},
                          overwrite=overwrite, protect=protect, check=check, write=write)

