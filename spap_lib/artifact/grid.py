"""Calibrate once, prune many: the data flow of the ablation grid (``notebooks/03_ablate``).

Per model, computed once and shared by every (method, sparsity) cell:
* the calibration windows and the inputs of decoder layer 0 with every layer's kwargs (they depend
  on the tokens and the attention/embedding weights, never on MLP channels);
* the dense per-channel statistics and block angular distances that score methods (magnitude,
  Wanda-SP, FLAP, CFSP) need: those methods do not propagate, so a cell costs no forward pass;
* the tokenized evaluation text.
Propagating methods (SPAP and its ablations, FASP) rerun layers 1… on their own pruned activations.
Every cell starts from a copy of the dense model. Rows are written after every cell (atomically)
and cells already in the table are skipped, so an interrupted grid resumes where it stopped.
Every cell is scored at each of ``eval_seqlens`` on the first ``eval_windows`` test windows; ``Eval``
adds a protocol for some cells only (the paper's whole test split at 2048 for the headline cells).
Each run appends its manifest to ``<results>.manifest.json`` (a table filled by many runs keeps the
provenance of each).
"""
from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path

import pandas as pd
import torch

from spap_lib import api, keys
from spap_lib.artifact.caches import dense_pass_key, load_dense_pass, save_dense_pass
from spap_lib.artifact.cells import DENSE, KEY, Eval, Protocols, Variant, done, effective, resolved
from spap_lib.artifact.manifest import manifest
from spap_lib.artifact.table import ABLATION, add_rows, read
from spap_lib.errors import ParameterError
from spap_lib.evaluation.data import Calibration, tokenize, wikitext
from spap_lib.evaluation.perplexity import perplexity_of_ids
from spap_lib.files import locked, write_json_atomic
from spap_lib.methods import Unsupported, get_method
from spap_lib.model.capture import first_layer_inputs
from spap_lib.model.gguf_tokenizer import rebuilt
from spap_lib.model.loading import Loaded
from spap_lib.pipeline.resume import LayerCheckpoint
from spap_lib.pipeline.sequential import RunSettings, allocation_inputs, dense_stats


class Grid:
    def __init__(self, model_name: str, loaded: Loaded, calib: Calibration, run: RunSettings = RunSettings(), *,
                 resume_root: str | Path | None = None, shared: str | Path | None = None):
        """``run``: batching, seed and progress of every cell. ``resume_root``: each layer-by-layer cell saves its
        finished layers in a folder below it, so a cell interrupted mid-way (hours on a CPU for SPAP on a 0.5B
        model) resumes at its next layer. ``shared``: a folder where the dense passes are kept, keyed and checked
        (``caches.save_dense_pass``), for the other processes of the same grid (``jobs``)."""
        self.model_name, self.loaded, self.calib = model_name, loaded, calib
        # which ids the rows' numbers come from: a row of another tokenizer is not this grid's (``cells.done``)
        self.tokenizer = (keys.tokenizer_digest(loaded.tokenizer), rebuilt(loaded.tokenizer))
        self.batch_size, self.chunk, self.seed, self.progress = run.batch_size, run.chunk, run.seed, run.progress
        self.resume_root = Path(resume_root) if resume_root is not None else None
        self.shared = Path(shared) if shared is not None else None
        # Every cell prunes a fresh copy of a pristine model kept in host memory: the device holds the
        # dense model (its perplexity, the layer-0 inputs) and one variant at a time, not three copies.
        self.pristine = loaded.copy(device="cpu")
        self.dense = loaded.model
        layers = loaded.adapter.layers()
        self.inputs = first_layer_inputs(loaded.model, layers, calib.windows, self.batch_size, loaded.device)
        # dense passes shared between cells, with what each took: "" the plain statistics, a variant's label
        # its error curves (the same at every sparsity)
        self._passes: dict[str, tuple[list, float]] = {}
        self._eval_ids = None

    def dense_pass(self, key: str = "", curve=None, channels: bool = True, share: float = 1.0,
                   in_bf16: bool = False) -> tuple[list, float]:
        """The dense statistics (with ``curve``'s error curves; without ``channels`` the angular distances only; on
        the first ``share`` of the windows, ``allocation_inputs``; with bf16 products when ``in_bf16``) computed once
        per ``key``, ``share`` and ``in_bf16``, and their seconds."""
        key = (key if share == 1 else f"{key} ({share} of the windows)") + (" (bf16 products)" if in_bf16 else "")
        if key not in self._passes:
            self._passes[key] = self._stored(key) or self._compute(key, curve, channels, share, in_bf16)
        return self._passes[key]

    def _compute(self, key: str, curve, channels: bool, share: float, in_bf16: bool) -> tuple[list, float]:
        t0 = time.perf_counter()
        run = RunSettings(batch_size=self.batch_size, chunk=self.chunk, progress=self.progress)
        stats = dense_stats(self.loaded.adapter, allocation_inputs(self.inputs, share, self.batch_size), run=run,
                            curve=curve, channels=channels, in_bf16=in_bf16)
        seconds = time.perf_counter() - t0
        if self.shared is not None:
            save_dense_pass(self._pass_file(key), stats, seconds, self._pass_key(key))
        return stats, seconds

    def _stored(self, key: str) -> tuple[list, float] | None:
        if self.shared is None:
            return None
        return load_dense_pass(self._pass_file(key), self._pass_key(key), self.loaded.device)

    def _pass_key(self, key: str) -> dict:
        return dense_pass_key(self.loaded, self.calib, key, self.batch_size, self.chunk)

    def _pass_file(self, key: str) -> Path:
        return self.shared / f"dense-{hashlib.sha256(key.encode()).hexdigest()[:12]}.pt"

    def eval_ids(self) -> tuple[torch.Tensor, str]:
        if self._eval_ids is None:
            text = wikitext("test")
            self._eval_ids = (tokenize(self.loaded.tokenizer, text.text), text.source)
        return self._eval_ids

    def fresh(self) -> Loaded:
        return self.pristine.copy(device=self.loaded.device)

    def prune(self, variant: Variant, sparsity: float) -> tuple[Loaded, dict]:
        algo = get_method(variant.method, **variant.hparams)
        pruned = self.fresh()
        stats, seconds = self.pass_for(variant)
        report = api.prune(pruned, self.calib, variant.method, sparsity, hparams=variant.hparams, seed=self.seed,
                           batch_size=self.batch_size, chunk=self.chunk, progress=self.progress, inputs=self.inputs,
                           stats=stats, resume_dir=self.resume_dir(variant, sparsity), clear_resume=False)
        if not algo.uniform_widths and algo.propagates:
            # the dense pass this cell's widths came from, computed once for the grid: a prune alone pays it
            report["allocation_seconds"] += seconds
        return pruned, report

    def pass_for(self, variant: Variant) -> tuple[list | None, float]:
        """The dense pass ``variant``'s prune reads, as the pipeline would take it, and its seconds (None, 0: none)."""
        algo = get_method(variant.method, **variant.hparams)
        dense = algo.dense_pass(algo.propagates)
        if dense is None:
            return None, 0.0
        if dense.curves:  # the curves are the variant's own, the same at every sparsity
            own = f"{variant.label} {resolved(variant.method, variant.hparams)}"  # a stored pass: the settings too
            return self.dense_pass(own, algo.error_curve, share=dense.share, in_bf16=dense.bf16)
        if dense.channels:
            return self.dense_pass(share=dense.share, in_bf16=dense.bf16)
        # the angular distances alone: what a prune of this variant pays by itself
        return self.dense_pass("blocks", channels=False, share=dense.share, in_bf16=dense.bf16)

    def resume_dir(self, variant: Variant, sparsity: float) -> Path | None:
        """Where a layer-by-layer cell keeps its finished layers: one folder per model, variant (with a
        hash of its hyperparameters), sparsity, calibration size and seed. None for a method that does not resume."""
        if self.resume_root is None or not get_method(variant.method, **variant.hparams).resumable:
            return None
        n, seqlen = self.calib.windows.shape
        tag = hashlib.sha256(json.dumps(variant.hparams, sort_keys=True).encode()).hexdigest()[:8]
        cell = f"{variant.label}@{sparsity}-{n}x{seqlen}-seed{self.seed}-{tag}"
        return self.resume_root / _slug(self.model_name) / _slug(cell)

    def perplexity(self, model, seqlen: int, windows: int | None) -> dict:
        ids, source = self.eval_ids()
        return {**perplexity_of_ids(model, ids, seqlen, windows, progress=self.progress), "source": source}


def _slug(name: str) -> str:
    """A folder name from a model alias or label (``flap/bias=false`` -> ``flap_bias=false``)."""
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", name)


def _row(grid: Grid, label: str, method: str, hparams: dict, sparsity: float, report: dict | None, ppl: dict,
         windows: int | None) -> dict:
    calib = grid.calib.describe()
    sp = report["sparsity"] if report else {}
    widths = sp.get("mlp_width", {}).get("pruned")
    return {
        "model": grid.model_name, "method": method, "label": label, "sparsity": float(sparsity),
        "eval_seqlen": ppl["seqlen"], "eval_windows": windows if windows is not None else -1, "ppl": ppl["ppl"],
        "achieved_sparsity": sp.get("achieved_decoder", 0.0), "achieved_total": sp.get("achieved_total", 0.0),
        "mlp_channel_ratio": sp.get("mlp_channel_ratio", 0.0),
        "uniform_width": not isinstance(widths, list), "propagate": report["propagate"] if report else None,
        # A cell resumed from an earlier process's saved layers records this process's time only, and the
        # first layer it pruned itself: the row must not read as the time of a whole prune.
        "prune_seconds": report["seconds"] if report else 0.0,
        "resumed_at_layer": report["resumed_at_layer"] if report else 0,
        # deciding the per-layer widths: the dense pass (shared between a grid's cells, and then not within
        # prune_seconds) and the allocation; 0 for uniform widths
        "allocation_seconds": report.get("allocation_seconds", 0.0) if report else 0.0,
        # the process's peak during the prune (the grid also holds the pristine and dense copies)
        "peak_rss_mb": report["memory"].get("peak_rss_mb") if report else None,
        "cuda_peak_mb": report["memory"].get("cuda_peak_mb") if report else None,
        "calib_split": calib["split"], "calib_source": calib["source"], "nsamples": calib["nsamples"],
        "seqlen": calib["seqlen"], "seed": grid.seed, "eval_source": ppl["source"], "tokenizer": grid.tokenizer[0],
        "hparams": json.dumps(hparams, sort_keys=True), "device": str(grid.loaded.device),
        "resolved_hparams": resolved(method, hparams),
    }


def check_grid(sparsities: list, eval_seqlens: list, results_csv: str | Path, figure: str | Path | None = None) -> None:
    """What a grid run is asked for, before any model is loaded: sparsities and evaluation lengths (non-empty,
    in range), a results table that is a file and reads whole (``table.read``), a figure format matplotlib
    writes."""
    from spap_lib.checks import Spec

    for name, values in (("sparsities", sparsities), ("eval_seqlens", eval_seqlens)):
        if not isinstance(values, list) or not values:
            raise ParameterError(f"{name} is {values!r}: give at least one value, e.g. "
                                 + ("[0.2]" if name == "sparsities" else "[512]"))
    for s in sparsities:
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 < s < 1:
            raise ParameterError(f"sparsity {s!r} in sparsities must be a fraction in (0, 1), e.g. 0.2")
    for s in eval_seqlens:
        Spec(int, ge=2).check("eval_seqlens entry", s)
    read(results_csv, ABLATION)
    if figure is not None:
        from matplotlib.figure import Figure

        formats = Figure().canvas.get_supported_filetypes()
        suffix = Path(figure).suffix.lstrip(".").lower()
        if suffix not in formats:
            raise ParameterError(f"figure {str(figure)!r}: matplotlib writes no {suffix or 'extensionless'!r} "
                                 f"files; end the name with one of .{', .'.join(sorted(formats))}")


def _todo(grid: Grid, table: pd.DataFrame, v: Variant, sparsity: float, protocols: Protocols,
          resume: bool) -> list[tuple[int, int | None]]:
    """The protocols of a cell the table holds no current row of (all of them without ``resume``)."""
    calib, current = grid.calib.describe(), effective(v.method, v.hparams)

    def probe(seqlen, windows):
        return {"model": grid.model_name, "label": v.label, "sparsity": float(sparsity), "eval_seqlen": seqlen,
                "eval_windows": windows if windows is not None else -1, "nsamples": calib["nsamples"],
                "seqlen": calib["seqlen"], "seed": grid.seed, "hparams": json.dumps(v.hparams, sort_keys=True)}

    return [p for p in protocols.of(v.label, sparsity)
            if not (resume and done(table, probe(*p), v.method, current, grid.tokenizer))]


def run_dense(grid: Grid, protocols: Protocols, results_csv: str | Path, resume: bool = True) -> None:
    """The dense reference's rows, those not in the table yet."""
    table = read(results_csv, ABLATION, keep_default_na=False)
    todo = _todo(grid, table, DENSE, 0.0, protocols, resume)
    if todo:
        add_rows(results_csv, [_row(grid, "dense", "dense", {}, 0.0, None, grid.perplexity(grid.dense, s, w), w)
                               for s, w in todo], KEY, ABLATION)


def run_cell(grid: Grid, v: Variant, sparsity: float, protocols: Protocols, results_csv: str | Path,
             resume: bool = True) -> None:
    """One cell: prune ``v`` at ``sparsity`` and add a row per protocol the table lacks. Rows are added under the
    table's lock (``table.add_rows``), so cells run by other processes keep theirs."""
    todo = _todo(grid, read(results_csv, ABLATION, keep_default_na=False), v, sparsity, protocols, resume)
    if not todo:
        return
    t0 = time.perf_counter()
    try:
        pruned, report = grid.prune(v, sparsity)
    except Unsupported as err:  # refused before any work: say so, keep the grid going
        print(f"{grid.model_name} {v.label}: skipped, {err}", flush=True)
        return
    for s, w in todo:  # row by row: a long evaluation interrupted keeps the rows already scored
        ppl = grid.perplexity(pruned.model, s, w)
        add_rows(results_csv, [_row(grid, v.label, v.method, v.hparams, sparsity, report, ppl, w)], KEY, ABLATION)
    layers_dir = grid.resume_dir(v, sparsity)
    if layers_dir is not None:  # the rows are written: the cell's finished layers are not needed any more
        LayerCheckpoint(layers_dir, {}).clear()
    if grid.progress:
        print(f"{grid.model_name} {v.label} @ {sparsity}: ppl {ppl['ppl']:.2f} ({time.perf_counter() - t0:.0f} s)",
              flush=True)


def run_grid(grid: Grid, variants: list[Variant], sparsities: list[float], eval_seqlens: list[int],
             eval_windows: int | None, results_csv: str | Path, resume: bool = True,
             extra_evals: list[Eval] = ()) -> pd.DataFrame:
    """Every variant × sparsity on one model (plus the dense reference), one cell after another, one row per
    evaluation protocol: each of ``eval_seqlens`` on ``eval_windows`` windows, plus the ``extra_evals`` that apply
    to the cell. Other models' and cells' rows always stay; ``resume=False`` only recomputes (and replaces) ours."""
    read(results_csv, ABLATION)  # a damaged table: refused before any cell runs
    protocols = Protocols(tuple(eval_seqlens), eval_windows, tuple(extra_evals))
    run_dense(grid, protocols, results_csv, resume)
    for sparsity in sparsities:
        for v in variants:
            run_cell(grid, v, sparsity, protocols, results_csv, resume)
    return read(results_csv, ABLATION)  # parsed once by pandas' defaults (empty fields NaN), whoever wrote which row


def record_run(results_csv: str | Path, **fields) -> Path:
    """Append this run's manifest (versions, git revision, parameters) to ``<results>.manifest.json``.

    The table is filled by many runs (models, methods and sparsities added over time, resumed cells):
    the file keeps every run's manifest under ``runs`` instead of the last run's only.
    """
    path = Path(results_csv).with_suffix(".manifest.json")
    with locked(path):  # two grids starting together each keep their entry
        old = json.loads(path.read_text()) if path.is_file() else {"runs": []}
        runs = old["runs"] if "runs" in old else [old]  # a file written before the log: its one run
        write_json_atomic(path, {"runs": [*runs, manifest(**fields)]})
    return path
