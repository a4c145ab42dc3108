"""The plan's model: the memory and seconds of pruning one model in one offload mode, from its config's counts.

``plan.plan`` validates the request and chooses the offload; this module prices it: where everything lives
(``layout``), the device, host and disk bytes (``memory``) and the seconds per stage (``seconds``), from the
throughput row's measured rates (``throughput.json``, ``bench/throughput.py``) and the method's own cost model.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from spap_lib.evaluation.perplexity import LOSS_CHUNK
from spap_lib.methods import Method
from spap_lib.methods.cost_model import Shapes, pricing
from spap_lib.numerics import bf16
from spap_lib.numerics.linalg import chunk_for, resolve_precision
from spap_lib.pipeline.sparsity import channels_removed
from spap_lib.settings import HealConfig

THROUGHPUT = json.loads((Path(__file__).resolve().parent / "throughput.json").read_text())
WIKITEXT2_TEST_TOKENS = 290_000  # whole test split, Llama-3/Qwen tokenizers (approximate; GPT-2 BPE: 287k)
GB = 1024**3
BATCH = "one batch through a layer"  # the replay's, before and after a layer's solve: never beside the solver's
PERPLEXITY, SAVE_CHECKS = "perplexity (dense + pruned)", "save and reload check"  # after the prune
HEALING = "healing"
# The share of the row's product rate a heal step reaches: the teacher's forward, the student's forward and backward,
# attention and the KL term's float32 softmaxes included (docs/heal.md: Memory and time, measured on SmolLM2-135M)
HEAL_ACHIEVED = 0.35


def working_share(memory: dict[str, float]) -> float:
    """Pruning's peak beyond the weights: the calibration activations, and the larger of a batch through the layer
    and the method's working set (the replay and the solve take turns)."""
    solver = sum(v for k, v in memory.items() if k not in ("weights", "evaluation logits", "calibration activations",
                                                             BATCH))
    return memory.get("calibration activations", 0) + max(memory.get(BATCH, 0), solver)


# What the process holds before any weight: Python, torch, transformers and a tokenizer; with CUDA initialised, the
# runtime's host side too (docs/scale.md: the 1.5B host-memory target).
RUNTIME_BYTES = 0.5 * 2**30
CUDA_RUNTIME_BYTES = 2.0 * 2**30
HOST_LINK_GB_S = 20.0  # host <-> GPU copies (PCIe 4.0 x16, effective) where a throughput row has no measured rate
DISK_GB_S = 1.5  # reading safetensors from an NVMe drive; assumed, not measured


@dataclass(frozen=True)
class Job:
    """What one plan prices: the method, the model's counts (``_counts``), the calibration and evaluation sizes,
    the throughput row and the run's settings."""

    algo: Method
    c: dict
    sparsity: float
    N: int  # calibration tokens
    seqlen: int
    eval_seqlen: int
    eval_windows: int | None
    device: str  # a row of throughput.json
    dtype: str
    batch_size: int
    chunk: int
    round_to: int | None
    heal: HealConfig | None = None  # a heal after the prune (``heal.tokens`` > 0)


@dataclass(frozen=True)
class Limits:
    """What the machine offers (None: not checked)."""

    device_memory_gb: float | None = None
    host_memory_gb: float | None = None
    disk_free_gb: float | None = None


@dataclass(frozen=True)
class _Layout:
    """Where one offload mode puts things, and the sizes every term reads."""

    gpu: bool
    resident: bool  # the model on the device (a CPU is its own host: cpu = none there)
    streamed: bool  # X and Y wait in pinned host memory and stream through the solver a chunk at a time
    b: int  # bytes per number of the model's dtype
    p: int  # bytes per number of the method's precision
    precision: str
    n_keep: int
    shapes: Shapes
    layer_bytes: float
    base_bytes: float  # embeddings, final norm, head


def layout(job: Job, offload: str) -> _Layout:
    c, algo = job.c, job.algo
    gpu = not job.device.startswith("cpu")
    b = {"auto": 2 if gpu else 4, "float32": 4, "bfloat16": 2, "float16": 2}[job.dtype]
    precision = resolve_precision(algo.precision, "cuda" if gpu else "cpu")
    p = 8 if precision == "float64" else 4
    n, L = c["width"], c["layers"]
    n_keep = max(1, n - channels_removed(job.sparsity, c["decoder"], L, c["per_channel"], n, job.round_to))
    resident = offload == "none" or (not gpu and offload == "cpu")
    # MLP inputs X and (a method whose update fits them token by token, ``uses_targets``) the dense targets Y: on the
    # device, but offloaded from a GPU in pinned host memory (``Onloader.calibration``). A least-squares refit needs
    # only the Gram matrix: its Y is never made.
    streamed = gpu and not resident
    # the sequential pipeline passes over an MLP's tokens in chunks sized for its width (``LayerProblem.of``); a
    # method of the whole model uses ``chunk`` as it is
    shapes = Shapes(N=job.N, d=c["hidden"], n=n, n_keep=n_keep, in_proj=c["in_proj"], solve_bytes=p, weight_bytes=b,
                    vocab=c["vocab"], tied=c["tied"], streamed=streamed,
                    chunk=chunk_for(n, job.chunk) if algo.pipeline == "layers" else job.chunk)
    return _Layout(gpu, resident, streamed, b, p, precision, n_keep, shapes, c["decoder"] / L * b,
                   (c["total"] - c["decoder"]) * b)


def price_memory(job: Job, offload: str, lay: _Layout) -> tuple[dict, float, float, float, float]:
    """The device's parts of the peak, the device and host peaks, the disk a disk offload needs and the saved
    checkpoint's size, in bytes."""
    c, algo, N, b = job.c, job.algo, job.N, lay.b
    d, n, L, V = c["hidden"], c["width"], c["layers"], c["vocab"]
    solver_inputs = (2 if algo.uses_targets else 1) * N * d * b
    # Device: the weights it holds, the activations of the layer being pruned, the solver's working set.
    memory = {"weights": c["total"] * b if lay.resident else 2 * lay.layer_bytes,  # a layer and its pruned copy
              # layer inputs and outputs (resident only; offloaded they wait in host memory), X and Y
              "calibration activations": (2 * N * d * b if lay.resident else 0)
              + (0 if lay.streamed else solver_inputs),
              BATCH: job.batch_size * job.seqlen * (c["heads"] * job.seqlen * 4 + 4 * n * b + 6 * d * b)}
    priced = pricing(algo)
    memory.update(priced.working_set(algo, lay.shapes))  # the solver's (or a whole-model method's) own
    kept = sum(priced.host_set(algo, lay.shapes).values())  # host memory: on a CPU the device's own
    if not lay.gpu:
        memory.update(priced.host_set(algo, lay.shapes))
    # a window's logits and the float32 loss of one span of positions; streamed, only one span's logits exist
    span = min(LOSS_CHUNK, job.eval_seqlen)
    memory["evaluation logits"] = (job.eval_seqlen if lay.resident else span) * V * b + span * V * 8
    calib_peak = memory["weights"] + working_share(memory)
    # streamed from disk, input embeddings that are not the head stay in the files (``offload.EmbeddingRows``)
    base = lay.base_bytes - (V * d * b if offload == "disk" and not c["tied"] else 0)
    peak_device = max(calib_peak, (memory["weights"] if lay.resident else base) + memory["evaluation logits"])
    # Host: what waits there. Resident on a GPU, from_pretrained reads the checkpoint into host memory first.
    hidden = 2 * N * d * b  # layer inputs and outputs between layers
    eval_hidden = (job.eval_windows or WIKITEXT2_TEST_TOKENS // job.eval_seqlen) * job.eval_seqlen * d * b
    runtime = CUDA_RUNTIME_BYTES if lay.gpu else RUNTIME_BYTES
    on_host = kept + (solver_inputs if lay.streamed else 0) if lay.gpu else 0  # a CPU row has them in ``memory``
    if not lay.gpu and lay.resident:
        peak_host = peak_device = peak_device + runtime
    elif offload == "none":
        peak_host = c["total"] * b + N * 8 + runtime + on_host
    elif offload == "cpu":
        peak_host = c["total"] * b + max(hidden, eval_hidden) + N * 8 + runtime + on_host
    else:  # disk: the rest of the base, one layer, one batch of hidden states (the rest in spill files), X and Y;
        # on a CPU the device terms are host memory too
        peak_host = base + lay.layer_bytes + max(job.batch_size, 1) * job.seqlen * d * b * 2 + N * 8 + \
            runtime + on_host
        if not lay.gpu:
            peak_host = peak_device = peak_host + max(calib_peak - memory["weights"], memory["evaluation logits"])
    # Disk (offload disk): the pruned layers spilled as they finish, then linked into the checkpoint; the
    # hidden states of two layers (inputs and outputs) in spill files.
    checkpoint = (c["total"] - L * (n - lay.n_keep) * c["per_channel"]) * b  # the saved model (tied weights once)
    disk_need = checkpoint + max(hidden, 2 * eval_hidden) if offload == "disk" else 0.0
    return memory, peak_device, peak_host, disk_need, checkpoint


def price_seconds(job: Job, offload: str, lay: _Layout) -> tuple[dict[str, float], tuple[str, ...]]:
    """Seconds per stage, and the stages the method declares (``Method.cost``).

    The model's own forward passes run at the measured rate. A method's stages are spap's chunked passes,
    solves and steps: on a GPU they reach a fraction of the rates measured on one large product or
    factorisation (``achieved``), and each sequential step costs ``step_seconds`` (launches, a synchronisation).
    Both are fitted to measured layers (docs/scale.md: The plan's time against measured layers); a CPU reaches
    its measured rates."""
    c, algo, N, b, row = job.c, job.algo, job.N, lay.b, THROUGHPUT[job.device]
    d, n, L, V = c["hidden"], c["width"], c["layers"], c["vocab"]
    rates, achieved, step = row["flops_per_second"], row.get("achieved", {}), row.get("step_seconds", 0.0)
    model_rate = rates["matmul_bf16" if b == 2 and lay.gpu else "matmul_fp32"]
    # bf16 products on a CPU row run at this machine's kernels' rate: the float32 rate where its CPU has no bf16
    # units (``bf16.rounded``), the row's bf16 rate where it has
    bf16_rate = "matmul_fp32" if not lay.gpu and bf16.rounded("cpu") else "matmul_bf16"
    keys = {"fp32": "matmul_tf32" if lay.precision == "tf32" and "matmul_tf32" in rates else "matmul_fp32",
            "bf16": bf16_rate, "solve": "cholesky_fp64" if lay.p == 8 else "cholesky_fp32"}

    def stage(work: dict[str, float]) -> float:  # one layer
        return sum(amount * step if r == "steps" else amount / (rates[keys[r]] * achieved.get(keys[r], 1.0))
                   for r, amount in work.items())

    mlp = 2 * n * c["per_channel"] * N  # N tokens through one layer's dense MLP
    attention = 2 * (c["decoder"] / L - n * c["per_channel"]) * N + 4 * N * job.seqlen * d  # and through the rest
    # a propagating prune replays every layer twice: to its MLP's input (the attention), then through the pruned
    # MLP, reading the attention's kept outputs (``capture.replay``); a non-uniform allocation first makes one
    # dense pass, over its share of the windows (``allocation_sample``), at its products' rate
    # (``allocation_precision``). Without propagation, one dense pass.
    allocating = not algo.uniform_widths and algo.propagates
    passes = (2 if algo.propagates else 1) + (algo.allocation_tokens(N) / N if allocating else 0)
    work = attention + mlp * (lay.n_keep / n if algo.propagates else 1)
    dense_rate = rates[bf16_rate] if algo.allocation_precision == "bf16" else model_rate
    dense_pass = (attention + mlp) * (passes - 2) / dense_rate if algo.propagates else 0.0
    batches = -(-N // (job.seqlen * job.batch_size))
    seconds = {"calibration forward passes": L * (work / model_rate + dense_pass + passes * batches * step)}
    own = pricing(algo).cost(algo, lay.shapes)
    for name, amount in own.items():
        seconds[name] = L * stage(amount)
    eval_tokens = job.eval_seqlen * job.eval_windows if job.eval_windows else WIKITEXT2_TEST_TOKENS
    evaluation = 2 * eval_tokens * (2 * c["decoder"] + 2 * d * V) / model_rate
    # X and Y through the solver from pinned host memory: the dense pass and the final refit (one of each), ‖Y‖²
    # (half), the rounds' samples and Adam's batches (about one and a half at 128 x 2048 tokens)
    if lay.streamed:
        solver_inputs = (2 if algo.uses_targets else 1) * N * d * b
        seconds["X and Y streamed to the device"] = L * 4 * solver_inputs / (row.get("pinned_copy_gb_s",
                                                                                       HOST_LINK_GB_S) * GB)
    transfers = _transfers(job, offload, lay, passes, eval_tokens)
    if transfers("prune"):
        seconds["onloading and hidden states"] = transfers("prune")
    seconds[PERPLEXITY] = evaluation + transfers("perplexity")
    if transfers("save"):
        seconds[SAVE_CHECKS] = transfers("save")
    return seconds, tuple(own)


def _transfers(job: Job, offload: str, lay: _Layout, passes: float, eval_tokens: int):
    """Seconds of weights, hidden states and spill files moved per phase (``prune``, ``perplexity``, ``save``)."""
    c, N, b, row = job.c, job.N, lay.b, THROUGHPUT[job.device]
    d, L = c["hidden"], c["layers"]
    reads, moved, spilled = {}, {}, {}  # per phase: layers read, bytes over the host link, bytes to spill files
    if not lay.resident or offload == "disk":
        # each layer onloaded once to prune it, twice for the perplexities and twice for the save checks
        reads = {"prune": c["decoder"] * b, "perplexity": 2 * c["decoder"] * b, "save": 2 * c["decoder"] * b}
    if offload != "none" and lay.gpu:
        # hidden states copied in and out a batch at a time on every pass over a layer (pageable host memory)
        moved = {"prune": L * 2 * passes * N * d * b, "perplexity": L * 4 * eval_tokens * d * b}
    if offload == "disk":  # hidden states written once and read (1 + passes) times per layer and pass
        spilled = {"prune": L * (2 + passes) * N * d * b, "perplexity": L * 4 * eval_tokens * d * b}
    pageable, disk = row.get("pageable_copy_gb_s", HOST_LINK_GB_S) * GB, DISK_GB_S * GB

    def seconds(phase: str) -> float:
        host = (reads.get(phase, 0) + moved.get(phase, 0)) / pageable if lay.gpu else 0.0
        return host + (reads.get(phase, 0) + spilled.get(phase, 0)) / disk if offload == "disk" else host
    return seconds




@dataclass(frozen=True)
class HealShapes:
    """What a heal's price reads: the dense teacher's counts (``plan._counts``) and the pruned student's kept MLP
    channels, summed over its layers (one width per layer, or the widths of a per-layer allocation)."""

    c: dict
    kept: int  # MLP channels the student keeps, all layers together

    @classmethod
    def uniform(cls, c: dict, n_keep: int) -> "HealShapes":
        return cls(c, c["layers"] * n_keep)


def price_heal(h: HealConfig, s: HealShapes, device: str, b: int) -> tuple[float, dict[str, float]]:
    """A heal's seconds and its device bytes by part (``spap_lib.heal``: the whole pruned model on the device with
    its gradients and AdamW's two moments for what learns, the dense teacher, one batch's activations, and the two
    models' logits with the KL term's float32 log-probabilities), on the ``throughput.json`` row ``device`` with the
    models' weights in ``b`` bytes a number."""
    c = s.c
    d, L, V = c["hidden"], c["layers"], c["vocab"]
    student, head = c["total"] - (L * c["width"] - s.kept) * c["per_channel"], V * d
    learns = {"all": student, "mlp": s.kept * c["per_channel"],
              "lora": h.lora_rank * (L * 8 * d + 3 * (L * d + s.kept))}[h.train]
    tokens = h.steps * h.batch * h.seqlen
    matmul = lambda params: params - c["total"] + c["decoder"] + head  # noqa: E731 - the embedding rows are looked up
    attention = 4 * h.seqlen * d * L  # per token: scores and their weighted sum, one forward
    flops = tokens * (2 * matmul(c["total"]) + 6 * matmul(student) + 4 * attention)
    rates = THROUGHPUT[device]["flops_per_second"]
    gpu = not device.startswith("cpu")
    fast = h.precision == "bf16" or (h.precision == "auto" and (gpu or not bf16.rounded("cpu")))
    rate = rates["matmul_bf16" if fast else "matmul_fp32"] * HEAL_ACHIEVED
    act = 2 if fast else 4
    batch = h.batch * h.seqlen
    memory = {"healing: the pruned model": student * b, "healing: gradients and AdamW state": learns * 12,
              "healing: the dense teacher": c["total"] * b,
              "healing: one batch's activations": batch * (L * 17 * d + 3 * s.kept) * act,
              "healing: logits and the KL term": batch * V * (2 * act + 12)}
    return flops / rate, memory
