"""A plan before every run: peak memory and time per stage, from the model's config alone.

``plan(model, method=..., nsamples=..., seqlen=..., device=...)`` reads a config (the shipped
``model_configs.json`` for the paper's aliases, so it works offline for them; the checkpoint's or
GGUF's config otherwise), builds the model on the meta device to count parameters exactly, and
applies the formulas below. It never reads a weight and never needs the target device: a laptop
plans an H100 run. ``02_prune`` prints it first and refuses a run that cannot fit.

Memory (bytes; ``b`` = weight/activation dtype bytes on the device, ``p`` = the method's precision
bytes, ``N = nsamples·seqlen`` calibration tokens, ``d`` hidden size, ``n`` MLP width, ``V`` vocab):

* weights: every parameter with ``offload="none"``; otherwise one decoder layer and its pruned copy
  (``cpu``: the rest waits in host memory; ``disk``: in the model files);
* calibration activations while a layer is pruned: layer inputs and dense outputs (on the device only
  with ``offload="none"``; ``cpu``: in host memory, ``2·N·d·b``; ``disk``: in spill files), MLP inputs
  ``X`` and (fitting methods) dense targets ``Y``, ``2·N·d·b`` (offloaded from a GPU: in pinned host memory,
  streamed through the solver a chunk at a time);
* the larger of one batch through the layer (the replay) and the layer's working set, which each method
  declares (``Method.working_set``: its largest stage; for fitting methods the Gram matrix and the system
  factorised in place, ``2·(n+1)²·p``, beside the float32 dense MLP and the solver's or Adam's state, and the
  update's token samples where ``X`` and ``Y`` are on the device); the update's start and best round (and, where
  ``X`` and ``Y`` stream, its token samples) wait in host memory (``Method.host_set``; a CPU's one memory);
* evaluation: the logits of one window, ``eval_seqlen·V·b``, and the loss of 256 positions at a time
  in float32, ``256·V·8`` (offloaded: with the embeddings and head on the device, and the logits of one span of
  256 positions at a time, ``256·V·b``: ``capture.streamed_logits``).

Healing after the prune (``heal``, ``pricing.price_heal``): its own peak, the whole model on the device (offload
``none``, the only mode that fits a heal): the pruned weights, ``12`` bytes of gradient and AdamW moments per learning
weight, the dense teacher, one batch's activations and both models' logits with the float32 KL term.

Host memory: the whole model (``none`` on a GPU: ``from_pretrained`` reads it there first; ``cpu``)
plus the hidden states between layers (calibration or evaluation, whichever is larger), ``X``/``Y`` where
they stream and ``Method.host_set``; or
(``disk``) the embeddings/head (input embeddings apart from the head stay in the files, read a batch's rows at
a time), one layer and one batch of hidden states (the rest waits in spill files). Plus the runtime
(``RUNTIME_BYTES``; with CUDA, its host side: ``CUDA_RUNTIME_BYTES``). On a CPU row device and host are one
memory, so ``cpu`` offload saves nothing there and ``disk`` is what shrinks it.

Time: floating-point operations of each stage (a method's own stages from ``Method.cost``) divided by a
throughput table (``throughput.json``: rates measured by ``bench/throughput.py`` on one large product or
factorisation; the RTX 4090's are spec-sheet assumptions). On a GPU a method's own stages reach a fraction of
those rates (``achieved``) and pay ``step_seconds`` per sequential step (a chunk, a solve, an Adam step:
launches and a synchronisation); an offloaded prune pays its onloads and hidden-state copies over pageable host
memory (``pageable_copy_gb_s``) and X/Y streamed from pinned memory. The H100's terms are fitted to measured
layers, and ``bench/plan_times.py`` shows every measured layer (GPU and CPU) beside its prediction; a CPU reaches
its measured rates.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from spap_lib.checks import ParameterError, Spec, check_values
from spap_lib.model.adapters import get_adapter
from spap_lib.model.offload import check_offload
from spap_lib.pipeline.blocks import round_to_value
from spap_lib.pipeline.sparsity import channels_removed
from spap_lib.pricing import (
    BATCH,
    GB,
    HEALING,
    PERPLEXITY,
    RUNTIME_BYTES,
    SAVE_CHECKS,
    THROUGHPUT,
    HealShapes,
    Job,
    Limits,
    layout,
    price_heal,
    price_memory,
    price_seconds,
    working_share,
)
from spap_lib.settings import PAPER, HealConfig, spec  # the paper's settings, the defaults of a prune

HERE = Path(__file__).resolve().parent
CONFIGS = json.loads((HERE / "model_configs.json").read_text())


def shipped_config(alias: str):
    """The config of a paper model alias from ``model_configs.json`` (no network), or None."""
    from transformers import AutoConfig

    if alias not in CONFIGS or alias.startswith("_"):
        return None
    fields = dict(CONFIGS[alias])
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def model_config(model: str):
    """The config a plan reads: the shipped one of a paper alias (offline), else the checkpoint's or GGUF's."""
    from spap_lib.model.loading import read_config, resolve

    return shipped_config(model) or read_config(resolve(model))


@dataclass
class Plan:
    model: str
    method: str
    device: str  # a key of throughput.json, e.g. "cpu-2core", "h100", "rtx4090"
    offload: str
    peak_device_gb: float
    peak_host_gb: float
    fits: bool
    seconds: dict[str, float] = field(default_factory=dict)  # per stage
    memory_gb: dict[str, float] = field(default_factory=dict)  # the peak's parts
    device_memory_gb: float | None = None
    host_memory_gb: float | None = None
    throughput_source: str = ""
    disk_gb: float = 0.0  # offload="disk": the pruned layers written as they finish
    disk_free_gb: float | None = None
    checkpoint_gb: float = 0.0  # the pruned checkpoint on disk
    least_device_gb: float | None = None  # the least device memory any offload mode needs (offload "auto")
    layers: int = 0  # decoder layers: ``seconds`` / ``layers`` is a layer's time
    method_stages: tuple[str, ...] = ()  # the stages of ``seconds`` the method declares (``Method.cost``)
    heal_gb: dict[str, float] = field(default_factory=dict)  # a heal's peak, by part (after the prune's)

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds.values())

    @property
    def prune_seconds(self) -> float:
        """The prune's own time: every stage but the perplexities and the save checks after it."""
        return sum(v for k, v in self.seconds.items() if k not in (PERPLEXITY, SAVE_CHECKS, HEALING))

    @property
    def prune_working_gb(self) -> float:
        """What pruning adds to the resident weights at its peak (activations, solver state, temporaries)."""
        return working_share(self.memory_gb)

    def smallest_fit(self) -> str:
        """Where a run that does not fit would: the least device memory it needs (its leanest offload mode) and the
        smallest device of ``throughput.json`` with that much."""
        need = self.least_device_gb if self.least_device_gb is not None else self.peak_device_gb
        rows = sorted((r["memory_gb"], name) for name, r in THROUGHPUT.items() if r.get("memory_gb", 0) >= need)
        device = f"e.g. {rows[0][1]} ({rows[0][0]} GB)" if rows else "more than any device planned here"
        return f"it needs at least {need:.1f} GB of device memory: {device}"

    def table(self) -> str:
        rows = [f"plan: {self.model}, {self.method}, on {self.device} (offload {self.offload})"]
        limit = f" of {self.device_memory_gb:.0f} GB" if self.device_memory_gb else ""
        host = f" of {self.host_memory_gb:.0f} GB" if self.host_memory_gb else ""
        rows.append(f"  peak device memory {self.peak_device_gb:8.2f} GB{limit}"
                    f"   peak host memory {self.peak_host_gb:.2f} GB{host}   fits: {'yes' if self.fits else 'NO'}")
        if not self.fits and not self.device.startswith("cpu"):
            rows.append(f"  {self.smallest_fit()}")
        if self.offload == "disk":
            free = f" of {size(self.disk_free_gb)} free" if self.disk_free_gb is not None else ""
            rows.append(f"  disk for the pruned layers {size(self.disk_gb)}{free}")
        rows.append(f"  pruned checkpoint {size(self.checkpoint_gb)}")
        w = max(28, *map(len, self.memory_gb))
        rows += [f"    {k:<{w}} {v:8.2f} GB" for k, v in self.memory_gb.items()]
        if BATCH in self.memory_gb:
            rows.append(f"    ({BATCH} and the method's parts take turns: the larger counts)")
        if self.heal_gb:
            rows.append(f"  healing after the prune {sum(self.heal_gb.values()):.2f} GB (the model resident: "
                        "offload none)")
            rows += [f"    {k:<{w}} {v:8.2f} GB" for k, v in self.heal_gb.items()]
        rows.append(f"  time {_duration(self.total_seconds)}, the prune {_duration(self.prune_seconds)} "
                    f"(rates: {self.throughput_source})")
        rows += [f"    {k:<28} {_duration(v):>10}" for k, v in self.seconds.items()]
        return "\n".join(rows)

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__} | {"total_seconds": self.total_seconds}


def size(gb: float) -> str:
    """A size for people: GB, MB below a gigabyte, KB below a megabyte, with two significant figures where a
    whole number would be too coarse (a tiny model's size rounded to zero megabytes says nothing)."""
    for unit, value in (("GB", gb), ("MB", gb * 2**10), ("KB", gb * 2**20)):
        if value >= 1 or unit == "KB":
            break
    if unit == "GB":
        return f"{value:.1f} GB"
    return f"{value:.0f} {unit}" if value >= 10 else f"{value:.2g} {unit}"


def _duration(s: float) -> str:
    return f"{s:.1f} s" if s < 120 else (f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h")


def _counts(config) -> dict:
    """Exact parameter counts from a meta-device model (no memory, no weights)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    adapter = get_adapter(model)
    layer = adapter.layers()[0]
    return {"total": sum(p.numel() for p in model.parameters()), "decoder": adapter.decoder_params(),
            "layers": len(adapter.layers()), "width": adapter.width(layer),
            "hidden": config.hidden_size, "vocab": model.get_input_embeddings().weight.shape[0],
            "heads": config.num_attention_heads, "per_channel": adapter.params_per_channel(layer),
            "in_proj": len(adapter.in_names),  # 2 for gate/up (GLU), 1 for OPT's fc1
            "tied": model.get_output_embeddings().weight is model.get_input_embeddings().weight}


def mlp_width(config) -> int:
    """The dense MLP width of a config's first layer, read by its adapter (``Adapter.width``)."""
    return _counts(config)["width"]


@dataclass
class HealPlan:
    """``spap heal``'s plan: a heal of a checkpoint pruned before, its device memory by part and its time."""

    model: str
    device: str  # a row of throughput.json
    memory_gb: dict[str, float]
    seconds: float
    device_memory_gb: float | None = None

    @property
    def peak_gb(self) -> float:
        return sum(self.memory_gb.values())

    @property
    def fits(self) -> bool:
        return self.device_memory_gb is None or self.peak_gb <= self.device_memory_gb

    def table(self) -> str:
        limit = f" of {self.device_memory_gb:.0f} GB" if self.device_memory_gb else ""
        w = max(map(len, self.memory_gb))
        return "\n".join([f"plan: heal {self.model} on {self.device}", f"  peak device memory {self.peak_gb:8.2f} GB"
                          f"{limit}   fits: {'yes' if self.fits else 'NO'}   time {_duration(self.seconds)}",
                          *(f"    {k:<{w}} {v:8.2f} GB" for k, v in self.memory_gb.items())])


def plan_heal(checkpoint: str, teacher: str, heal: HealConfig, device: str = "cpu-2core",
              device_memory_gb: float | None = None) -> HealPlan:
    """The heal of a pruned ``checkpoint`` from its dense ``teacher`` priced as the heal after a prune is
    (``pricing.price_heal``), from the two configs alone: the checkpoint's kept widths (``spap_mlp_widths`` where its
    layers differ) against the teacher's counts. A teacher of another shape is refused here, before any weight."""
    if device not in THROUGHPUT:
        raise ParameterError(f"unknown device {device!r} for planning: throughput.json has {', '.join(THROUGHPUT)}")
    student, c = model_config(checkpoint), _counts(model_config(teacher))
    widths = getattr(student, "spap_mlp_widths", None) or [mlp_width(student)] * c["layers"]
    if (len(widths), student.hidden_size) != (c["layers"], c["hidden"]) or max(widths) > c["width"]:
        raise ParameterError(f"the teacher {teacher} ({c['layers']} layers of {c['hidden']}, MLP width {c['width']}) "
                             f"is not the model {checkpoint} was pruned from ({len(widths)} layers of "
                             f"{student.hidden_size}, MLP widths up to {max(widths)}): heal from the dense model the "
                             "checkpoint was pruned from")
    gpu = not device.startswith("cpu")
    seconds, memory = price_heal(heal, HealShapes(c, sum(widths)), device, 2 if gpu else 4)
    memory = {k: v / GB for k, v in memory.items()} | ({} if gpu else {"runtime": RUNTIME_BYTES / GB})
    return HealPlan(checkpoint, device, memory, seconds, device_memory_gb)


def layer_shapes(config, sparsity: float, round_to: int | None = None) -> dict:
    """One layer's ``hidden``, dense ``width``, ``kept`` width and input projections, and the ``layers``: what the
    all-reduce estimate of a data-parallel prune reads (``distributed.allreduce_lines``)."""
    c = _counts(config)
    removed = channels_removed(sparsity, c["decoder"], c["layers"], c["per_channel"], c["width"], round_to)
    return {"hidden": c["hidden"], "width": c["width"], "kept": max(1, c["width"] - removed),
            "in_proj": c["in_proj"], "layers": c["layers"]}


def local_device(device: torch.device) -> tuple[str, float | None]:
    """The ``throughput.json`` row and memory (GB) of ``device`` on this machine: a CUDA device's name
    matched to a row (its total memory), else this project's measured CPU row (available RAM)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device).lower().replace(" ", "")
        row = next((r for r in THROUGHPUT if r.replace("-", "") in name), "h100")
        return row, torch.cuda.get_device_properties(device).total_memory / GB
    return "cpu-2core", available_host_gb()


def available_host_gb() -> float | None:
    """Host memory available to a new allocation (Linux MemAvailable), in GB; None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) / 2**20
    except (OSError, StopIteration):
        return None


@dataclass(frozen=True)
class PlanRequest:
    """What ``plan`` prices (its keywords): a prune's settings, the paper's by default (``RunConfig``), and the
    machine: ``device`` names a row of ``throughput.json`` (its ``memory_gb`` is the default ``device_memory_gb``);
    ``dtype="auto"`` is float32 on a CPU row, bfloat16 on a GPU row. ``offload="auto"`` picks the fastest of none,
    cpu, disk that fits the device, the host memory and (disk) ``disk_free_gb``; limits left at None are not
    checked. ``round_to`` prices the kept width the prune will have (``pipeline.channels_removed``). ``config``
    skips reading the model's config again when the caller has it."""

    method: str = PAPER.method
    hparams: dict | None = None
    sparsity: float = PAPER.sparsity
    nsamples: int = PAPER.nsamples
    seqlen: int = PAPER.seqlen
    eval_seqlen: int = PAPER.eval_seqlen
    eval_windows: int | None = PAPER.eval_windows
    device: str = "cpu-2core"
    device_memory_gb: float | None = None
    host_memory_gb: float | None = None
    disk_free_gb: float | None = None
    offload: str = "auto"
    dtype: str = "auto"
    batch_size: int = 1
    chunk: int = 8192
    round_to: int | None = None
    config: object = None
    heal: HealConfig | None = None

    def __post_init__(self) -> None:  # a prune's settings take ``RunConfig``'s types and ranges
        check_values(*((name, getattr(self, name), spec(name)) for name in ("nsamples", "seqlen", "eval_seqlen",
                                                                              "sparsity")),
                     ("eval_windows", self.eval_windows, spec("eval_windows", optional=True)),
                     ("batch_size", self.batch_size, Spec(int, ge=1)),
                     ("device_memory_gb", self.device_memory_gb, Spec(float, gt=0, optional=True)),
                     ("host_memory_gb", self.host_memory_gb, Spec(float, gt=0, optional=True)),
                     ("disk_free_gb", self.disk_free_gb, Spec(float, ge=0, optional=True)))


def plan(model: str, **settings) -> Plan:
    """Peak memory and time of pruning ``model`` (alias, checkpoint dir or .gguf) before any weight is read;
    ``settings`` are ``PlanRequest``'s."""
    from spap_lib.methods import get_method

    r = PlanRequest(**settings)
    device, offload = r.device, r.offload
    if device not in THROUGHPUT:
        raise ParameterError(f"unknown device {device!r} for planning: throughput.json has {', '.join(THROUGHPUT)} "
                             "(add a row with bench/throughput.py)")
    check_offload(offload)
    round_to = round_to_value(r.round_to)
    algo = get_method(r.method, **(r.hparams or {}))
    config = r.config or model_config(model)
    algo.check_config(config)  # an architecture the method cannot prune is refused here too
    job = Job(algo=algo, c=_counts(config), sparsity=r.sparsity, N=r.nsamples * r.seqlen, seqlen=r.seqlen,
              eval_seqlen=r.eval_seqlen, eval_windows=r.eval_windows, device=device, dtype=r.dtype,
              batch_size=r.batch_size, chunk=r.chunk, round_to=round_to,
              heal=r.heal if r.heal is not None and r.heal.tokens else None)
    limits = Limits(r.device_memory_gb or THROUGHPUT[device].get("memory_gb"), r.host_memory_gb, r.disk_free_gb)
    if offload != "auto":
        return _plan_one(model, offload, job, limits)
    plans = [_plan_one(model, mode, job, limits) for mode in ("none", "cpu", "disk")]
    chosen = next((p for p in plans if p.fits), plans[-1])
    chosen.least_device_gb = min(p.peak_device_gb for p in plans)
    return chosen


def _plan_one(model: str, offload: str, job: Job, limits: Limits) -> Plan:
    lay = layout(job, offload)
    memory, peak_device, peak_host, disk_need, checkpoint = price_memory(job, offload, lay)
    seconds, stages = price_seconds(job, offload, lay)
    heal = {}
    if job.heal is not None:  # after the prune: its peak is its own, with the whole model on the device
        seconds[HEALING], heal = price_heal(job.heal, HealShapes.uniform(job.c, lay.n_keep), job.device, lay.b)
        peak_device = max(peak_device, sum(heal.values()) + (0 if lay.gpu else RUNTIME_BYTES))
        peak_host = peak_device if not lay.gpu else peak_host
    fits = (job.heal is None or offload == "none") and offload in job.algo.offloads and \
           (limits.device_memory_gb is None or peak_device / GB <= limits.device_memory_gb) and \
           (limits.host_memory_gb is None or peak_host / GB <= limits.host_memory_gb) and \
           (limits.disk_free_gb is None or disk_need / GB <= limits.disk_free_gb)
    row = THROUGHPUT[job.device]
    return Plan(model, job.algo.name, job.device, offload, peak_device / GB, peak_host / GB, fits, seconds,
                {k: v / GB for k, v in memory.items()}, limits.device_memory_gb, limits.host_memory_gb,
                "; ".join(filter(None, (row["source"], row.get("fitted")))), disk_need / GB, limits.disk_free_gb,
                checkpoint / GB, layers=job.c["layers"], method_stages=stages,
                heal_gb={k: v / GB for k, v in heal.items()})
