"""The sequential pipeline: prune decoder layers in order, one layer on the device at a time.

Data flow only; the algorithm lives in ``spap_lib.methods``. With ``propagate=True`` (the paper's
setting) layer i+1 is calibrated on the outputs of the already-pruned layer i; with ``False`` every
layer sees dense activations (one pass per layer instead of two).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
from tqdm import tqdm

from spap_lib.methods import LayerProblem, Method
from spap_lib.methods.parts import allocation as alloc
from spap_lib.methods.parts.allocation import ALLOCATIONS
from spap_lib.methods.scores import ScoreMethod
from spap_lib.model.adapters import Adapter
from spap_lib.model.capture import Batching, first_layer_inputs, replay
from spap_lib.model.offload import Onloader
from spap_lib.numerics.collective import broadcast_, total, world
from spap_lib.numerics.linalg import (
    NumericalError,
    check_finite,
    chunk_for,
    matmul_precision,
    nonfinite_parameters,
    products,
    resolve_precision,
    token_energies,
)
from spap_lib.numerics.stats import ChannelStats, block_angular
from spap_lib.pipeline.sparsity import SparsityPlan


@dataclass(frozen=True)
class RunSettings:
    """How the pipeline runs a prune: settings of memory and reporting, and the two that decide results (``seed``,
    ``propagate``)."""
    batch_size: int = 1  # calibration windows per forward
    chunk: int = 8192  # tokens per pass of the Gram and error sums (memory, not results)
    seed: int = 0
    propagate: bool | None = None  # layer i+1 calibrated on the pruned layer i's outputs; None: the method's own
    progress: bool = True


def dense_stats(adapter: Adapter, inputs: tuple, *, onloader: Onloader | None = None,
                run: RunSettings = RunSettings(), curve=None, channels: bool = True,
                in_bf16: bool = False) -> list[ChannelStats]:
    """One pass through the dense layers: every layer's ``ChannelStats`` and block angular distance.

    ``inputs`` are the layer-0 inputs and per-layer kwargs from ``first_layer_inputs``; ``curve``
    (``Method.error_curve``) adds each layer's error curve, for the "error" allocation, and takes its statistics
    (from the curve's own Gram pass where that reads every token). Without ``channels``
    the pass is the layers' replay alone, for the angular distances (``ChannelStats.blocks_only``): no MLP
    inputs kept, no pass over their activations. With ``in_bf16`` the replay's products take bf16 inputs
    (``linalg.products``); the statistics and curves are then taken from its float32 outputs as they are.
    """
    onloader = onloader or _resident(adapter)
    hidden, kwargs = inputs
    stats = []
    for i in tqdm(range(len(adapter.layers())), desc="dense statistics", disable=not run.progress):
        with onloader.layer(i) as layer:
            watch = adapter.mlp_input_module(layer) if channels or curve is not None else None
            with products(in_bf16, onloader.device):
                out, X = replay(layer, hidden, {b: kw[i] for b, kw in kwargs.items()}, _batching(onloader, run),
                                watch)
            if X is None:
                s = ChannelStats.blocks_only(total(hidden.shape[0] * hidden.shape[1]))
            else:
                check_finite(X, f"layer {i}: the MLP inputs")
                mlp = adapter.get_mlp(layer)
                c = chunk_for(mlp.width, run.chunk)
                if curve is None:
                    s = ChannelStats.of(mlp, X, c)
                else:  # with the energy of every token's block output, which its MLP output joins; the curve's pass
                    # takes the statistics too
                    s, points = curve(mlp, X, c, token_energies(out.reshape(-1, out.shape[-1]), c, onloader.device))
                    s.curve = points
        s.angular = block_angular(hidden, out)
        stats.append(s)
        hidden = out
    return stats


def allocation_inputs(inputs: tuple, share: float, batch_size: int) -> tuple:
    """The layer-0 inputs of the first ``share`` of the calibration windows, whole batches, at least one: the
    windows are random draws, so these are a uniform sample of them. The dense pass that decides a propagating
    method's widths runs on them (``Method.allocation_sample``); the prune itself on every window."""
    hidden, kwargs = inputs
    k = max(batch_size, round(share * hidden.shape[0] / batch_size) * batch_size)
    return inputs if k >= hidden.shape[0] else (hidden[:k], kwargs)


def _batching(onloader: Onloader, run: RunSettings, finite: str | None = None) -> Batching:
    """A replay's batches, placed where the onloader keeps activations and calibration inputs."""
    return Batching(run.batch_size, onloader.device, onloader.activations, onloader.calibration, finite)


def _resident(adapter: Adapter) -> Onloader:
    layer = adapter.layers()[0]
    return Onloader(adapter.model, adapter.layers(), next(layer.parameters()).device)


@dataclass
class Shared:
    """What runs on one calibration set may share (the grid, ``grid.Grid``): the layer-0 ``inputs`` (hidden states
    and kwargs) and the dense channel statistics ``stats``; computed where None."""
    inputs: tuple | None = None
    stats: list[ChannelStats] | None = None


def prune_model(adapter: Adapter, windows: torch.Tensor, method: Method, plan: SparsityPlan, *,
                run: RunSettings = RunSettings(), onloader: Onloader | None = None, shared: Shared | None = None,
                checkpoint=None) -> dict:
    """Prune every decoder layer's MLP of ``adapter.model`` in place.

    ``run``: batching, seed and progress, and ``propagate`` (default: the method's own setting), which calibrates
    layer i+1 on the outputs of the pruned layer i (SPAP, FASP) instead of the dense one. Score methods without
    propagation work from dense statistics only (``shared.stats``, computed here unless given): one pass. A
    non-uniform ``allocation`` is decided on dense statistics before the first layer is pruned.
    ``onloader`` (``spap_lib.model.offload``) says where weights wait between layers; default: resident, on the
    device the first layer is on. ``shared.inputs`` (layer-0 inputs and kwargs) may be shared between runs on the
    same calibration set. Returns timings (``allocation_seconds``: deciding the per-layer widths, within
    ``seconds``), per-layer diagnostics and the plan as data: the dense channel indices kept in every layer
    (``kept_channels``), enough to re-apply the same selection to the dense model.
    ``checkpoint`` (``resume.LayerCheckpoint``): layer-by-layer pruning saves every finished layer there
    and resumes after the last one it finds (removed once the run completes).
    """
    model, inputs, stats = adapter.model, (shared or Shared()).inputs, (shared or Shared()).stats
    propagate = method.propagates if run.propagate is None else run.propagate
    run = replace(run, propagate=propagate, progress=run.progress and world().rank == 0)  # one bar for several ranks
    batch_size = run.batch_size
    onloader = onloader or _resident(adapter)
    method.prepare(adapter)  # architecture checks before any work
    t0 = time.perf_counter()
    layers = adapter.layers()
    if inputs is None:
        with onloader.base():
            inputs = first_layer_inputs(model, layers, windows, batch_size, onloader.device, store=onloader.activations)
    uniform, dense = method.uniform_widths, method.dense_pass(propagate)
    curve = method.error_curve if dense is not None and dense.curves else None  # the curves are the method's own
    t_alloc = time.perf_counter()
    scoring = dense is not None and dense.scores  # a pass the method's scores need anyway
    if dense is not None and (stats is None or curve and any(s.curve is None for s in stats)):
        stats = dense_stats(adapter, allocation_inputs(inputs, dense.share, batch_size), onloader=onloader, run=run,
                            curve=curve, channels=dense.channels, in_bf16=dense.bf16)
    if scoring:
        t_alloc = time.perf_counter()
    removals = [plan.n_remove] * len(layers) if uniform else \
        method.removals(stats, plan.width, plan.n_remove * len(layers),
                        _allocation_scores(adapter, method, onloader, stats))
    if plan.round_to is not None and not uniform:
        removals = alloc.rounded(removals, plan.width, plan.round_to)
    # what deciding the per-layer widths cost here: the dense pass (unless the scores need it anyway) and the
    # allocation itself
    allocation_seconds = 0.0 if uniform else time.perf_counter() - t_alloc
    resumed = 0  # layers an earlier, interrupted run had finished (``checkpoint``)
    if scoring:
        per_layer, kept = _prune_from_stats(adapter, method, onloader, stats, removals)
    else:
        # Hand the layer-0 inputs to the loop in a list it empties, so they are freed once layer 0 has
        # used them (unless a caller such as the grid keeps its own reference to share them).
        hidden, kwargs = inputs
        carry = [hidden]
        del inputs, hidden
        per_layer, kept, resumed = _prune_sequential(adapter, method, onloader, (carry, kwargs), removals, run,
                                                     checkpoint)
    adapter.set_config_width([len(k) for k in kept])
    if checkpoint is not None and checkpoint.clear_when_done:
        checkpoint.clear()
    return {"seconds": time.perf_counter() - t0, "propagate": propagate, "layers": per_layer, "kept_channels": kept,
            "resumed_at_layer": resumed, "allocation_seconds": allocation_seconds}


def _allocation_scores(adapter: Adapter, method: Method, onloader: Onloader, stats: list[ChannelStats]):
    """Every layer's dense channel scores, for an allocation that needs them (FLAP's global one); else None."""
    if "scores" not in ALLOCATIONS[method.allocation].needs:
        return None
    scores = []
    for i, s in enumerate(stats):
        with onloader.layer(i) as layer:
            scores.append(method.allocation_scores(adapter.get_mlp(layer), s))
    return scores


def _prune_from_stats(adapter: Adapter, method: ScoreMethod, onloader: Onloader, stats: list[ChannelStats],
                      removals: list[int]):
    per_layer, kept = [], []
    for i, (s, n_remove) in enumerate(zip(stats, removals)):
        with onloader.layer(i) as layer:
            result = _same_on_every_rank(method.select(adapter.get_mlp(layer), s, n_remove))
            adapter.set_mlp(layer, result.mlp)
            onloader.finished(i)
        per_layer.append({"layer": i, "removed": n_remove, **result.info})
        kept.append(result.keep.tolist())
    return per_layer, kept


def _same_on_every_rank(result):
    """Rank 0's kept channels and weights on every rank of a data-parallel prune (``collective.broadcast_``): they
    computed them from the same sums, and a kernel that is not bit-reproducible across devices cannot make the
    ranks' next layers start from different weights. One process: ``result`` as it is."""
    mlp = result.mlp
    broadcast_([result.keep, *mlp.W_in, *(b for b in mlp.b_in if b is not None), mlp.W_out,
                *([mlp.b_out] if mlp.b_out is not None else [])])
    return result


def _prune_sequential(adapter: Adapter, method: Method, onloader: Onloader, inputs: tuple[list, dict],
                      removals: list[int], run: RunSettings, checkpoint=None):
    carry, kwargs = inputs
    hidden = carry.pop()  # the only reference: layer i's inputs are freed once layer i+1's exist
    batch_size, propagate = run.batch_size, run.propagate
    precision = resolve_precision(method.precision, onloader.device)
    per_layer, kept, start = [], [], 0
    state = checkpoint.load() if checkpoint is not None else None
    if state is not None:  # layers 0..next-1 were finished by an earlier, interrupted run
        start, per_layer, kept = state["next"], state["per_layer"], state["kept"]
        for i in range(start):
            with onloader.layer(i) as layer:
                adapter.set_mlp(layer, checkpoint.layer(i, adapter.get_mlp(layer)))
                onloader.finished(i)
        del hidden
        hidden = checkpoint.hidden(state, onloader.activations, batch_size)
    for i in tqdm(range(start, len(adapter.layers())), desc=f"{method.name} layers", disable=not run.progress,
                  initial=start, total=len(adapter.layers())):
        layer_kwargs = {b: kw[i] for b, kw in kwargs.items()}
        with onloader.layer(i) as layer:
            if onloader.mode == "disk":  # resident weights were checked once, before the run
                bad = nonfinite_parameters(layer)
                if bad:
                    raise NumericalError(f"layer {i}'s weights are not finite ({'; '.join(bad[:5])}): the model files "
                                         "are damaged; spap cannot prune them")
            # Propagating, the dense outputs are never used (the pruned layer's replace them): stop at the MLP,
            # keeping the attention's outputs, which the pruned layer's replay reuses.
            attention = adapter.attention_module(layer) if propagate else None
            out, X = replay(layer, hidden, layer_kwargs, _batching(onloader, run), adapter.mlp_input_module(layer),
                            outputs=not propagate, attention=attention)
            check_finite(X, f"layer {i}: the MLP inputs")
            problem = LayerProblem.of(method, adapter.get_mlp(layer), X, removals[i], onloader.device,
                                      chunk=run.chunk, seed=run.seed, layer_index=i)
            # A layer whose output no channel affects (all-zero activations or output projection) has
            # nothing to fit: the dense weights of the kept channels already reproduce it exactly.
            with matmul_precision(precision):
                result = problem.keep_dense() if method.fits and problem.nothing_to_fit else method.prune(problem)
            del problem, X
            result = _same_on_every_rank(result)
            adapter.set_mlp(layer, result.mlp)
            # Next layer's calibration inputs: through the pruned layer (paper) or the dense one.
            if propagate:
                checked = _batching(onloader, run, finite=f"layer {i}: the outputs of the pruned layer")
                out = replay(layer, hidden, layer_kwargs, checked, attention=attention, reuse=out)[0]
            onloader.finished(i)
        hidden = out
        per_layer.append({"layer": i, "removed": removals[i], **result.info})
        kept.append(result.keep.tolist())
        if checkpoint is not None:
            checkpoint.save(i, result.mlp, hidden, batch_size, per_layer, kept)
    return per_layer, kept, start
