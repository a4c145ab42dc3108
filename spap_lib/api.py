"""``prune``: one call that prunes a loaded model in place and reports what it did; ``shape_variants``: the
pruned shapes a profile (``evaluation.profile``) compares, from one load.

The notebooks' other calls live beside it, one job per module: ``validate.check_run`` (every parameter
before any weight is read), ``caches`` (calibration windows and dense perplexity reused between
notebooks) and ``checkpoint.save`` (installed only after its logits are finite and its reload matches).
Each takes explicit arguments and returns plain data (dicts), so the notebooks stay thin and the same
calls serve scripts and benchmarks.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from spap_lib.checks import Spec, check_sparsity, check_values, fits_context
from spap_lib.errors import ParameterError
from spap_lib.evaluation.data import Calibration, calibration_windows
from spap_lib.evaluation.profile import Variant, free_device_memory
from spap_lib.keys import source_key
from spap_lib.methods import DEFAULT_METHOD, Method, get_method
from spap_lib.model.adapters import COUNTED_OVER
from spap_lib.model.loading import Loaded, context_length, load
from spap_lib.numerics.collective import world
from spap_lib.numerics.linalg import NumericalError, nonfinite_parameters, resolve_precision
from spap_lib.numerics.memory import measured
from spap_lib.pipeline.blocks import resolve_round_to
from spap_lib.pipeline.distributed import one_process, record, share
from spap_lib.pipeline.sequential import RunSettings, Shared, prune_model
from spap_lib.pipeline.sparsity import plan_sparsity


@dataclass(frozen=True)
class PruneOptions:
    """What ``prune`` takes beside the model, the calibration, the method and the sparsity (keywords of ``prune``).

    ``propagate=None`` uses the method's own setting; ``inputs``/``stats`` let a grid share the layer-0 inputs and
    dense statistics of one calibration set between runs (see ``grid.Grid``). ``chunk``: tokens per pass of the
    Gram and error sums (memory, not results: the plan counts ``chunk·(n+2d)·4`` bytes for it). ``resume_dir``:
    every finished layer is saved there, and a run interrupted before the last layer resumes after the last saved
    one (``spap_lib.pipeline.resume``); it serves the layer-by-layer prunes (SPAP, its ablations, FASP): the
    one-pass score methods and the whole-model methods are minutes where SPAP is hours, and start over.
    ``clear_resume=False`` keeps the finished layers there (the grid clears them once the cell's rows are
    written)."""

    hparams: dict | None = None
    seed: int = 0
    batch_size: int = 1
    propagate: bool | None = None
    progress: bool = True
    inputs: tuple | None = None
    stats: list | None = None
    round_to: int | str | None = None
    chunk: int = 8192
    resume_dir: str | Path | None = None
    clear_resume: bool = True

    def __post_init__(self) -> None:
        check_values(("hparams", self.hparams, Spec(dict, optional=True)), ("seed", self.seed, Spec(int, ge=0)),
                     ("batch_size", self.batch_size, Spec(int, ge=1)),
                     ("propagate", self.propagate, Spec(bool, optional=True)), ("chunk", self.chunk, Spec(int, ge=1)))


def prune(loaded: Loaded, calib: Calibration, method: str = DEFAULT_METHOD, sparsity: float = 0.2,
          **options) -> dict:
    """Prune ``loaded.model`` in place with ``method`` at ``sparsity``; ``options`` are ``PruneOptions``'s
    (``hparams``, ``seed``, ``round_to``, ``resume_dir`` ...). Validates everything before any work is done."""
    o = PruneOptions(**options)
    algo = get_method(method, **(o.hparams or {}))
    # a number, a format's block size, or "auto": the default for this model's MLP width (``pipeline.blocks``)
    round_to = resolve_round_to(o.round_to, loaded.adapter.width(loaded.adapter.layers()[0]),
                                algo.pipeline == "layers")
    work = check_sparsity(sparsity) > 0  # sparsity 0: the dense model unchanged, whatever the method
    if work:
        algo.check_settings(round_to=round_to, propagate=o.propagate, resume_dir=o.resume_dir)
    if work and loaded.offload not in algo.offloads:
        raise ParameterError(f"method {algo.name!r} needs offload {' or '.join(map(repr, algo.offloads))}, got "
                             f"offload={loaded.offload!r}")
    if work and algo.pipeline == "model":  # the method declares its pipeline: the whole model at once
        one_process(algo)
        return _prune_whole_model(loaded, calib, algo, sparsity, o)
    return _prune_layers(loaded, calib, algo, method, (sparsity, round_to), o)


def _prune_layers(loaded: Loaded, calib: Calibration, algo: Method, method: str, budget: tuple[float, int | None],
                  o: PruneOptions) -> dict:
    """The sequential pipeline (``pipeline.sequential``) on every decoder layer's MLP channels, resumable; ``method``
    is the label asked for, ``budget`` the sparsity and the kept widths' multiple."""
    (sparsity, round_to), seed = budget, o.seed
    work = sparsity > 0
    plan = plan_sparsity(loaded.adapter, sparsity, round_to)
    _check_prunable(loaded, calib)
    if work and algo.fits and calib.windows.numel() < plan.width:
        warnings.warn(
            f"only {calib.windows.numel()} calibration tokens for MLP width {plan.width}: the least-squares "
            f"steps are underdetermined and overfit the calibration set; use nsamples x seqlen >= {4 * plan.width}",
            stacklevel=3,
        )
    before = loaded.param_counts()
    checkpoint = None
    if o.resume_dir is not None and work:
        from spap_lib.pipeline.resume import LayerCheckpoint, code_hash

        checkpoint = LayerCheckpoint(o.resume_dir, {
            "model": source_key(loaded.source), "method": method, "threads": threads(loaded.device),
            "hparams": algo.hparams(), "n_remove": plan.n_remove,
            "propagate": o.propagate, "calibration": calib.describe(), "seed": seed, "batch_size": o.batch_size,
            "device": loaded.device.type, "dtype": str(loaded.model.dtype), "round_to": round_to,
            "code": code_hash(algo), "world_size": world().size}, clear_when_done=o.clear_resume)
    torch.manual_seed(seed)
    start, stop = share(calib.windows.shape[0])  # every window in one process; this rank's share of several
    with measured(loaded.device) as memory, checkpoint or contextlib.nullcontext():  # the folder's lock, released
        settings = RunSettings(batch_size=o.batch_size, chunk=o.chunk, seed=seed, propagate=o.propagate,
                               progress=o.progress)
        run = prune_model(loaded.adapter, calib.windows[start:stop], algo, plan, run=settings,
                          onloader=loaded.onloader, shared=Shared(o.inputs, o.stats), checkpoint=checkpoint) \
            if work else {"propagate": algo.propagates if o.propagate is None else o.propagate, "seconds": 0.0,
                          "resumed_at_layer": 0, "allocation_seconds": 0.0, "layers": [],
                          "kept_channels": [list(range(plan.width))] * plan.layers}
    widths = [len(k) for k in run["kept_channels"]]
    return _report(loaded, calib, algo, {**run, "seed": seed, "memory": memory, "method": method}, before,
                   precision=resolve_precision(algo.precision, loaded.device),
                   sparsity={"requested": sparsity, "round_to": round_to, "counted_over": COUNTED_OVER,
                             "mlp_share_of_decoder": plan.mlp_share,
                             "mlp_channels_removed": plan.n_remove * plan.layers,
                             "mlp_width": {"dense": plan.width,
                                           "pruned": widths[0] if len(set(widths)) == 1 else widths},
                             "mlp_channel_ratio": plan.mlp_ratio},
                   kept_channels=run["kept_channels"], distributed=record(calib.windows.shape[0]))


def shape_variants(model: str, sparsities: list[float], round_tos: list[int | None], method: str = "magnitude", *,
                   device: str = "auto", progress: bool = False, slicing: list[float] = ()) -> dict[str, Variant]:
    """``{"dense": ..., "20%": ..., "20% r64": ..., "slicegpt 20%": ...}``: the dense model and its pruned
    shapes, each pruned by ``method`` (default magnitude: the widths SPAP gets at the same sparsity, in
    seconds, no activations needed) from one load, on a copy per variant; only the kept channels are
    returned. ``slicing``: SliceGPT's slicing fractions, as plans (its shapes, shortcut matrices included)."""
    from spap_lib.methods.slicegpt.slicing import SLICED_FORMAT, plan_for

    loaded = load(model, device=device)
    for s in sparsities:
        for r in round_tos:
            plan_sparsity(loaded.adapter, s, r)  # an invalid sparsity or multiple fails before any work
    calib = calibration_windows(loaded.tokenizer, 2, 64, 0)  # a score method barely reads activations
    variants = {"dense": Variant(model)}
    for s in sparsities:
        for r in round_tos:
            pruned = loaded.copy()
            report = prune(pruned, calib, method, s, round_to=r, progress=progress)
            label = f"{s:.0%}" + (f" r{r}" if r else "")
            variants[label] = Variant(model, report["kept_channels"], report["sparsity"]["achieved_decoder"], r)
            del pruned
    dense_params = loaded.adapter.decoder_params()
    for s in slicing:
        plan = plan_for(loaded.model.config, s)
        sliced = loaded.copy()
        SLICED_FORMAT.shape(sliced.model, plan)
        variants[f"slicegpt {s:.0%}"] = Variant(model, None, 1 - sliced.adapter.decoder_params() / dense_params,
                                                reshape=(SLICED_FORMAT.marker, plan))
        del sliced
    device = loaded.device
    del loaded
    free_device_memory(device)  # the profiling processes need this memory, not our caches
    return variants


def threads(device: torch.device) -> int | None:
    """CPU results are bit-identical per seed at one thread count (reductions split by thread), so a resumed
    CPU prune must use the same count; on a GPU the host's threads do not enter the result."""
    return torch.get_num_threads() if device.type == "cpu" else None


def _check_prunable(loaded: Loaded, calib: Calibration) -> None:
    fits_context("seqlen", calib.windows.shape[1], context_length(loaded.model.config))
    bad = nonfinite_parameters(loaded.model)
    if bad:
        raise NumericalError(f"the model's weights are not finite ({'; '.join(bad[:5])}): the checkpoint is "
                             "damaged; spap cannot prune it. Reload or re-download the model.")


def _prune_whole_model(loaded: Loaded, calib: Calibration, algo: Method, sparsity: float,
                       options: PruneOptions) -> dict:
    """A method of the "model" pipeline: its own sparsity definition and plan (``Method.prune_model``), the
    parameters actually removed counted from the real tensors, the same report keys as the MLP-channel methods."""
    algo.prepare(loaded.adapter)
    _check_prunable(loaded, calib)
    before = loaded.param_counts()
    width = loaded.adapter.width(loaded.adapter.layers()[0])
    torch.manual_seed(options.seed)
    with measured(loaded.device) as memory:
        run = algo.prune_model(loaded, calib, sparsity, batch_size=options.batch_size, progress=options.progress)
    own = {"propagate": True, "resumed_at_layer": 0}  # no resume: it runs in one process
    return _report(loaded, calib, algo, {**run, **own, "seed": options.seed, "memory": memory}, before,
                   precision=run["precision"],
                   sparsity={"requested": sparsity, **run["sparsity"],
                             "mlp_width": {"dense": width, "pruned": width}, "mlp_channel_ratio": 0.0},
                   **run["plan"])


def _report(loaded: Loaded, calib: Calibration, algo: Method, run: dict, before: dict, *, precision: str,
            sparsity: dict, **extra) -> dict:
    """What every prune returns (and ``save`` records): the request, the sparsity achieved, counted from
    the real tensors before and after, and the run's time, memory, seed and per-layer details (``run``; its
    ``method``: the label asked for); ``extra`` is the plan (``kept_channels``, or a whole-model method's
    ``slicing``)."""
    after = loaded.param_counts()
    return {
        "method": run.get("method") or algo.name, "hparams": algo.hparams(), "propagate": run["propagate"],
        "seed": run["seed"],
        "calibration": calib.describe(),
        "sparsity": {**sparsity, "achieved_decoder": 1 - after["decoder"] / before["decoder"],
                     "achieved_total": 1 - after["total"] / before["total"]},
        "params": {"dense": before, "pruned": after},
        "seconds": run["seconds"],  # of this run: a resumed one did not redo the first layers
        "allocation_seconds": run.get("allocation_seconds", 0.0),  # within seconds: the per-layer widths decided
        "resumed_at_layer": run["resumed_at_layer"],
        "offload": loaded.offload,
        "precision": precision,  # "auto" resolved for this device
        "memory": run["memory"],
        "layers": run["layers"],
        **extra,
    }
