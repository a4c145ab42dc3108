"""``check_run``: every parameter of a run checked before any weight is read.

It reads the model's config (GGUF: its metadata) and the weight files' headers only, builds the model on
the meta device for the sparsity plan and the method's architecture checks, and asks ``spap_lib.plan``
whether the run fits this device, the host's memory and the disk. Each refusal names the fix in the
caller's language (``errors.option``).
"""
from __future__ import annotations

import copy
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from spap_lib.artifact.checkpoint import protected
from spap_lib.artifact.manifest import check_out_dir
from spap_lib.checks import Spec, check_sparsity, check_values, fits_context
from spap_lib.errors import OutputError, ParameterError, current_surface, option
from spap_lib.evaluation.data import check_available
from spap_lib.methods import Method, get_method
from spap_lib.model.adapters import get_adapter
from spap_lib.model.formats import format_of
from spap_lib.model.loading import context_length, pick_device, read_config, resolve
from spap_lib.model.offload import check_offload, remove_dead_spills
from spap_lib.model.sources import ModelSource
from spap_lib.model.stores import SafetensorsStore
from spap_lib.numerics import bf16
from spap_lib.pipeline import resume
from spap_lib.pipeline.blocks import AUTO, AUTO_MIN_WIDTH, is_auto, resolve_round_to, round_to_value, width_note
from spap_lib.pipeline.distributed import one_process
from spap_lib.pipeline.sparsity import SparsityPlan, plan_sparsity
from spap_lib.plan import Plan, available_host_gb, local_device, mlp_width, plan, size
from spap_lib.settings import HealConfig, spec


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
    round_to: int | None = None  # resolved: a format's name becomes its block, "auto" the model's default
    round_to_auto: bool = False  # ``round_to`` came from "auto"

    def summary(self) -> str:
        lines = [f"model {self.source.name}: {self.config.model_type} from {self.source.kind} {self.source.path}, "
                 f"context {self.context or 'unknown'} tokens"]
        uniform = self.method is None or self.method.uniform_widths
        if self.method is not None:
            lines.append(f"method {self.method.name}: {self.method.effective_hparams()}")  # the settings that act
            if self.method.parts():
                lines.append("parts: " + ", ".join(f"{k} {v}" for k, v in self.method.parts().items()))
        if self.plan is not None:
            p = self.plan
            lines.append(f"remove {p.n_remove} of {p.width} MLP channels per layer{'' if uniform else ' on average'} "
                         f"({p.mlp_ratio:.1%} of channels; MLP = {p.mlp_share:.1%} of decoder params)")
            if p.round_to is not None:
                lines.append(f"round_to {p.round_to}{' (auto)' * self.round_to_auto}: kept width "
                             f"{p.width - p.n_remove}, {p.achieved:.2%} of the decoder's parameters removed for the "
                             f"{p.sparsity:.0%} requested")
            elif self.round_to_auto:
                lines.append(f"round_to auto: the method's own widths (auto rounds to {AUTO} an MLP of "
                             f"{AUTO_MIN_WIDTH} or more that {AUTO} divides)")
            if uniform and (note := width_note([p.width - p.n_remove])):
                lines.append(note)
        if not uniform:
            lines.append(f"allocation {self.method.allocation}: per-layer widths; the checkpoint loads with "
                         "spap_lib.load, not stock transformers (which reads one intermediate_size for every layer)")
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


@dataclass(frozen=True)
class RunRequest:
    """What ``check_run`` is asked (its keywords): ``RunConfig``'s settings of the parts this run has, each left
    None where the run has no such part (no ``method``: nothing is pruned; no ``sparsity``: no plan; no
    ``nsamples``: no calibration; no ``eval_seqlen``: no perplexity), and the folders it writes."""

    method: str | None = None
    sparsity: float | None = None
    hparams: dict | None = None
    nsamples: int | None = None
    seqlen: int | None = None
    eval_seqlen: int | None = None
    eval_windows: int | None = None
    seed: int = 0
    round_to: int | str | None = None
    propagate: bool | None = None
    device: str = "auto"
    offload: str = "auto"
    out_dir: str | Path | None = None
    run_dir: str | Path | None = None
    overwrite: bool = False
    spill_dir: str | Path | None = None
    resume_dir: str | Path | None = None
    heal: HealConfig | None = None  # a heal after the prune: priced by the plan, the model resident

    def __post_init__(self) -> None:  # each setting's type and range are ``RunConfig``'s
        check_values(*((name, getattr(self, name), spec(name, optional=name != "seed"))
                       for name in ("nsamples", "seqlen", "eval_seqlen", "eval_windows", "seed", "propagate",
                                    "hparams")), ("overwrite", self.overwrite, Spec(bool)))


def check_run(model: str, **settings) -> RunCheck:
    """Check every parameter of a run before any weight is read; raise with the fix, else say what will run.
    ``settings`` are ``RunRequest``'s.

    Reads only the model's config (GGUF: its metadata): the architecture, the context length that ``seqlen``/
    ``eval_seqlen`` must fit, and (on the meta device, no memory) the sparsity plan and the method's architecture
    checks. ``out_dir`` must be new, empty or (``overwrite``) a previous spap checkpoint, and neither the source
    model nor ``run_dir``. ``offload`` ``auto`` becomes the fastest of none, cpu, disk that the plan says fits this
    device, the host's available memory and the free space under ``spill_dir`` (disk); without a plan (no method
    or calibration size), ``none``. The disk under ``out_dir`` must hold the pruned checkpoint, and a ``resume_dir``
    must be new, empty, or hold this run's finished layers. Dead runs' spill folders under ``spill_dir`` go.
    """
    r = RunRequest(**settings)
    auto, round_to = is_auto(r.round_to), None if is_auto(r.round_to) else round_to_value(r.round_to)  # q4_k_m: 256
    check_offload(r.offload)
    bf16.policy()  # SPAP_BF16_PRODUCTS, read by every bf16 product of the run
    algo = get_method(r.method, **(r.hparams or {})) if r.method is not None else None
    if algo is not None and r.sparsity:
        one_process(algo)  # before the model is read: a whole-model method under torchrun
    pick_device(r.device)
    spill_root = _existing(Path(r.spill_dir) if r.spill_dir else Path(tempfile.gettempdir()))
    remove_dead_spills(spill_root)
    if r.resume_dir is not None:
        resume.check_folder(r.resume_dir)  # a file, a foreign folder or state.json: before reading the model
        _apart(r.resume_dir, r.out_dir)
    source = resolve(model)  # the config and, for a local folder, the weight files' headers
    out_state = None
    if r.out_dir is not None:  # an unusable name, a foreign folder, the source itself: before the plan
        out_state = check_out_dir(r.out_dir, overwrite=r.overwrite,
                                  protect=protected(source, **{"the run folder": r.run_dir}))
    if r.offload == "disk" and source.kind == "dir":
        SafetensorsStore(source.path)  # refuses pickle (.bin) checkpoints, naming the offloads that still work
    config = read_config(source)
    if auto:
        round_to = resolve_round_to("auto", mlp_width(config), algo is None or algo.pipeline == "layers")
    context, sparsity_plan = check_config(model, config, algo, r.sparsity,
                                          {"seqlen": r.seqlen, "eval_seqlen": r.eval_seqlen},
                                          {"round_to": round_to, "propagate": r.propagate, "resume_dir": r.resume_dir})
    check = RunCheck(source, config, context, algo, sparsity_plan, round_to=round_to, round_to_auto=auto,
                     offload=r.offload, out_state=out_state)
    if r.sparsity is not None and algo is not None:
        _check_plan(model, check, r, spill_root)
    if check.offload == "auto":
        check.offload = "none"
    check_available(calibration=bool(r.nsamples), evaluation=r.eval_seqlen is not None)  # the cheaper checks first
    return check


def _check_plan(model: str, check: RunCheck, r: RunRequest, spill_root: Path) -> None:
    """A prune's offload, resume folder, memory, time and disk: the plan on this machine, refused with what to change
    where it does not fit; ``check.offload`` becomes what the plan chose."""
    algo, layers = check.method, check.method.pipeline == "layers"  # else the method's own sparsity, no plan yet
    if r.sparsity > 0:
        check.offload = _allowed_offload(algo, r.offload)
    if layers and r.resume_dir is not None:
        resume.check_folder(r.resume_dir, _resume_key(check.source, r.method, algo, check.plan, r.device, seed=r.seed,
                                                      round_to=check.round_to, propagate=r.propagate,
                                                      calibration={"nsamples": r.nsamples, "seqlen": r.seqlen}))
    if not (r.nsamples and r.seqlen and layers and r.sparsity > 0):
        return
    dev = pick_device(r.device)
    row, memory_gb = local_device(dev)
    check.memory_time = p = plan(
        model, method=r.method, hparams=r.hparams, sparsity=r.sparsity, nsamples=r.nsamples, seqlen=r.seqlen,
        eval_seqlen=r.eval_seqlen or r.seqlen, eval_windows=r.eval_windows, device=row, device_memory_gb=memory_gb,
        round_to=check.round_to, host_memory_gb=available_host_gb() if dev.type != "cpu" else None,
        offload=check.offload, disk_free_gb=shutil.disk_usage(spill_root).free / 2**30, config=check.config,
        heal=r.heal)
    if not p.fits:
        raise _does_not_fit(p, dev, spill_root)
    check.offload = p.offload
    if r.out_dir is not None:
        _check_space(r.out_dir, p.checkpoint_gb)


def _resume_key(source: ModelSource, method: str, algo: Method, plan: SparsityPlan, device: str, **settings) -> dict:
    """What a resume folder's layers must have been pruned with, as far as it is known before loading (the keys of
    ``api.prune``'s fingerprint but the calibration windows' digest and the batch size): the model's content (not
    its path), the method and its code, budget and settings, the device, dtype and world size, and on a CPU the
    thread count."""
    from spap_lib.api import threads
    from spap_lib.keys import source_key
    from spap_lib.model.dtypes import pick_dtype
    from spap_lib.numerics.collective import world

    dev = pick_device(device)
    return {"model": source_key(source), "method": method, "hparams": algo.hparams(), "n_remove": plan.n_remove,
            "threads": threads(dev), "device": dev.type, "dtype": str(pick_dtype("auto", dev)),
            "code": resume.code_hash(algo), "world_size": world().size, **settings}


def check_config(model: str, config, algo: Method | None, sparsity: float | None, windows: dict[str, int | None],
                 settings: dict | None = None) -> tuple[int | None, SparsityPlan | None]:
    """The checks of a run that need only the model's config, shared by ``check_run`` and ``spap plan``: every
    window of ``windows`` (``{"seqlen": 2048, "eval_seqlen": 2048}``) within the context; with a ``sparsity``, a
    dense model, the run ``settings`` the method refuses (``Method.check_settings``: round_to, propagate,
    resume_dir), the sparsity plan and the architecture the method cannot prune, on a meta-device copy (no memory).
    Returns the context length and the sparsity plan (None without a sparsity, or for a whole-model method)."""
    settings = {"round_to": None, "propagate": None, "resume_dir": None, **(settings or {})}
    if sparsity is not None:
        _check_dense(model, config)
    context = context_length(config)
    for name, tokens in windows.items():
        fits_context(name, tokens, context, model)
    if sparsity is None:
        return context, None
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # shapes only: no memory, no weights; a copy, since methods may edit it
        adapter = get_adapter(AutoModelForCausalLM.from_config(copy.deepcopy(config)))
    if algo is not None and check_sparsity(sparsity) > 0:
        algo.check_settings(**settings)
    layers = algo is None or algo.pipeline == "layers"  # else the method's own sparsity
    sparsity_plan = plan_sparsity(adapter, sparsity, settings["round_to"]) if layers else None
    if algo is not None:
        algo.prepare(adapter)  # e.g. FLAP's bias slot, an architecture the method cannot reshape
        if sparsity_plan is not None:  # the model as the prepared config builds it: with the slots it adds
            with torch.device("meta"):
                rebuilt = get_adapter(AutoModelForCausalLM.from_config(adapter.model.config))
            sparsity_plan = sparsity_plan.prepared(rebuilt)
    return context, sparsity_plan


def _check_dense(model: str, config) -> None:
    """A pruned checkpoint is not pruned again: a layout of spap's own (per-layer widths, a sliced stream) is one."""
    fmt = format_of({k: v for k, v in config.to_dict().items() if v})
    if fmt is not None:
        raise ParameterError(f"{model} is already pruned: a {fmt.describe}; prune a dense model")


def _allowed_offload(algo, offload: str) -> str:
    """The offload asked for, if the method takes it; ``auto`` with one choice is that choice."""
    if offload == "auto":
        return algo.offloads[0] if len(algo.offloads) == 1 else offload
    if offload not in algo.offloads:
        raise ParameterError(f"method {algo.name!r} needs offload {' or '.join(map(repr, algo.offloads))} "
                             f"(or 'auto'), not {offload!r}")
    return offload


def _does_not_fit(p: Plan, dev: torch.device, spill_root: Path) -> ParameterError:
    """The refusal of a run the plan says will not fit, naming each limit and the ways out."""
    return ParameterError(
        f"this run does not fit with {option('offload', p.offload)}: the plan needs "
        f"{size(p.peak_device_gb)} on {p.device} ({_limit(p.device_memory_gb)}), {size(p.peak_host_gb)} "
        f"of host memory ({_limit(p.host_memory_gb)})"
        + (f", {size(p.disk_gb)} of disk under {spill_root} ({_limit(p.disk_free_gb)})" if p.offload == "disk" else "")
        + ". Use " + (f"{option('offload', 'disk')} (weights read layer by layer), " if p.offload != "disk"
                      else f"{_spill_hint()}, ")
        + "fewer calibration tokens (nsamples x seqlen), hparams {'precision': 'float32'}, or a larger "
        + (f"device ({p.smallest_fit()})" if dev.type != "cpu" else "machine")
        + f".\n{p.table()}")


def _limit(gb: float | None) -> str:
    return f"{size(gb)} available" if gb is not None else "not checked"


def _apart(resume_dir, out_dir) -> None:
    """The checkpoint replaces ``out_dir`` whole: the finished layers may not live in it, nor it in them."""
    if out_dir is None:
        return
    a, b = Path(resume_dir).expanduser().absolute(), Path(out_dir).expanduser().absolute()
    if a == b or b in a.parents or a in b.parents:
        raise ParameterError(f"{option('resume_dir', resume_dir)} and {option('out_dir', out_dir)} overlap: the saved "
                             "checkpoint replaces its folder whole; give the finished layers a folder of their own")


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
                          f"free some space or choose {option('out_dir', '<a folder on a larger disk>')}")
