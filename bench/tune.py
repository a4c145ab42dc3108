"""How spap's SPAP defaults were chosen: held-out MLP reconstruction error on real layers.

For a few decoder layers of SmolLM2-135M we capture the dense MLP inputs for calibration windows
(the fit set) and for disjoint windows of another seed (the held-out set), prune each layer with a
grid of hyperparameters (one varied at a time around a base point) and record the relative
held-out error ``‖Y − f(X)‖² / ‖Y‖²`` of the pruned MLP. Held-out, not calibration, error: the
closed-form steps can overfit a small calibration set, which the fit error would reward.

    python bench/tune.py --out bench/results/tune.csv
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np
import pandas as pd
from common import (  # bench/, the script's own folder
    RANDOM_NOTE,
    device_arguments,
    layer_bench_parser,
    mlp_inputs,
    random_calibration,
    random_checkpoint,
    synchronize,
)

import spap_lib as sl
from spap_lib.artifact.figures import markdown_table
from spap_lib.artifact.manifest import device_name, git_revision
from spap_lib.checks import scalar
from spap_lib.files import write_csv_atomic, write_text_atomic
from spap_lib.methods import LayerProblem
from spap_lib.numerics import bf16

PENALTY_GRID = {
    "t": [0.0, 0.5, 1.0],
    "alpha": [0.0, 0.5, 0.9],
    "rho0": [1e-3, 1e-2, 1e-1],
    "tau": [1.2, 1.5, 2.0],
    "K": [10, 20, 30],
    "damp": [1e-4, 1e-3, 1e-2],
}
# lr in units of each tensor's RMS (lr_scale="rms"); on SmolLM2 (RMS ≈ 0.19) 5e-3 is about the absolute 1e-3
UPDATE_GRID = {"lr": [5e-5, 5e-4, 5e-3], "adam_steps": [10, 50], "am_iters": [0, 5, 20]}


def scalar_point(point: str) -> dict:
    """``"am_iters=20,adam_steps=5"`` as ``{"am_iters": 20, "adam_steps": 5}``."""
    return {k: scalar(v) for k, v in (kv.split("=") for kv in point.split(","))}


def main(argv=None) -> None:
    ap = layer_bench_parser(__doc__)
    ap.add_argument("--which", choices=["penalty", "update", "both", "methods"], default="both",
                    help="'methods': compare the registered methods in --methods at the base point")
    ap.add_argument("--methods", default="spap,spap_gd", help="with --which methods")
    ap.add_argument("--base", default="", help="overrides of the base point, e.g. t=0.5,K=20")
    ap.add_argument("--grid", default="", help="replace the update grid, e.g. 'lr=1e-3,3e-3;am_iters=5,20'")
    ap.add_argument("--points", default="",
                    help="joint settings, one per ';', e.g. 'method=fasp;am_iters=5,batch_tokens=1024' (each point "
                         "is the base point with these overrides; 'method' names another registered method)")
    ap.add_argument("--held", type=int, default=None, help="held-out windows (default nsamples // 4, at least 4); "
                    "the same count and seqlen give the same windows, so runs at two budgets compare")
    ap.add_argument("--bf16-products", default="",
                    help="kernels of the bf16 products, e.g. 'native,rounded' (SPAP_BF16_PRODUCTS): every setting runs "
                         "under each, side by side")
    ap.add_argument("--repeat", type=int, default=1, help="time every setting on every layer this many times, "
                    "interleaved; a layer's time is the median")
    device_arguments(ap)
    ap.add_argument("--out", default="bench/results/tune.csv")
    args = ap.parse_args(argv)

    layers = [int(x) for x in args.layers.split(",")]
    n_held = args.held or max(4, args.nsamples // 4)
    device = sl.model.loading.pick_device(args.device)
    if args.random:  # the model's shapes, built here: no model files needed, e.g. on a GPU machine without them
        source = random_checkpoint(args.model, max(layers) + 1, device)
        loaded = sl.load(str(source), device=args.device)
        vocab = loaded.model.config.vocab_size
        fit = random_calibration(vocab, args.nsamples, args.seqlen, seed=0)
        held = random_calibration(vocab, n_held, args.seqlen, seed=1)
    else:
        loaded = sl.load(args.model, device=args.device)
        fit = sl.calibration_windows(loaded.tokenizer, args.nsamples, args.seqlen, seed=0)
        held = sl.calibration_windows(loaded.tokenizer, n_held, args.seqlen, seed=1)
    X_fit, X_held = mlp_inputs(loaded, fit.windows, layers), mlp_inputs(loaded, held.windows, layers)
    plan = sl.plan_sparsity(loaded.adapter, args.sparsity)
    base = {k: type(v)(v) for k, v in sl.get_method("spap").hparams().items()}
    overrides = {}
    for kv in filter(None, args.base.split(",")):
        k, v = kv.split("=")
        overrides[k] = scalar(v)  # e.g. lr=1e-4 or lr_scale=absolute; the method checks types and ranges
    base.update(overrides)

    update_grid = UPDATE_GRID
    if args.grid:
        update_grid = {k: [scalar(x) for x in v.split(",")]
                       for k, v in (part.split("=") for part in args.grid.split(";"))}
    grids = []
    if args.which in ("penalty", "both"):
        grids += [({**base, "am_iters": 0, k: v}, "penalty", k) for k, vs in PENALTY_GRID.items() for v in vs]
    if args.which in ("update", "both"):
        grids += [({**base, k: v}, "update", k) for k, vs in update_grid.items() for v in vs]
    if args.points:
        grids = []
        for point in args.points.split(";"):
            hp = {**base, **scalar_point(point), "point": point}
            grids.append((hp, "points", "point"))
    elif args.which == "methods":
        grids = [({**base, "method": m}, "methods", "method") for m in args.methods.split(",")]
    methods = []
    for hp, stage, varied in grids:
        name = hp.get("method", "spap")
        known = sl.get_method(name).hparams()
        # only what --base, the stage or the point sets: another method keeps its own defaults where they
        # differ from SPAP's (spap_gd: sketch_resample=False)
        point = scalar_point(hp["point"]) if stage == "points" else {}
        chosen = {k: v for k, v in hp.items() if k in overrides or k == varied or k in point or base.get(k) != v}
        methods.append((hp, stage, varied, sl.get_method(name, **{k: v for k, v in chosen.items() if k in known})))
    if args.bf16_products:  # each setting once per kernel choice, labelled with it
        methods = [({**hp, "bf16_products": k, varied: f"{hp[varied]} [{k}]"}, stage, varied, method)
                   for hp, stage, varied, method in methods for k in args.bf16_products.split(",")]
    # Every setting on a layer before the next layer, ``--repeat`` times over: a CPU's speed drifts over minutes,
    # so the settings compared share each stretch of it; a setting's time on a layer is the median of its runs.
    times: dict = {}
    rows = []
    for r in range(args.repeat):
        for i in layers:
            dense = loaded.adapter.get_mlp(loaded.adapter.layers()[i])
            for j, (hp, stage, varied, method) in enumerate(methods):
                if "bf16_products" in hp:
                    os.environ["SPAP_BF16_PRODUCTS"] = hp["bf16_products"]
                synchronize(device)  # CUDA runs ahead of the host: time the work, not its launch
                t0 = time.perf_counter()
                res = method.prune(LayerProblem.of(method, dense, X_fit[i], plan.n_remove, seed=0, layer_index=i))
                synchronize(device)
                times.setdefault((j, i), []).append(time.perf_counter() - t0)
                print(stage, varied, hp[varied], i, f"run {r + 1}", f"{times[j, i][-1]:.1f}s", flush=True)
                if r:
                    continue
                Y = dense(X_held[i])
                err = float((res.mlp(X_held[i]) - Y).pow(2).sum() / Y.pow(2).sum())
                rows.append({"stage": stage, "varied": varied, "value": hp[varied], "layer": i,
                             "heldout_rel_error": err, "fit_rel_error": res.info.get("rel_error_final"),
                             "point_index": j, **hp})
                print(stage, varied, hp[varied], i, f"{err:.5f}", flush=True)
            for row in rows:
                row["seconds"] = float(np.median(times[row["point_index"], row["layer"]]))
                row["runs"] = len(times[row["point_index"], row["layer"]])
            write_csv_atomic(args.out, pd.DataFrame(rows))  # every finished layer kept, should a later one fail
    frame = pd.DataFrame(rows)
    write_csv_atomic(args.out, frame)
    summary = frame.groupby(["stage", "varied", "value"], sort=False)[["heldout_rel_error", "seconds"]].mean()
    fasp = [v for v in frame["value"].unique() if str(v).split(" [")[0] == "method=fasp"] if args.points else []
    if fasp:  # time as a multiple of FASP's, same run (its first kernel choice: FASP takes no bf16 products)
        summary["seconds / fasp"] = summary["seconds"] / summary.loc[("points", "point", fasp[0]), "seconds"]
    command = " ".join(["python", "bench/tune.py", *(sys.argv[1:] if argv is None else argv)])
    units = f"; bf16 units: {'yes' if bf16.has_bf16_units() else 'none'}" if args.bf16_products else ""
    runs = f" (the median of {args.repeat} runs, the settings interleaved layer by layer)" if args.repeat > 1 else ""
    write_text_atomic(args.out.replace(".csv", ".md"), (
        f"# SPAP hyperparameter sweep\n\nCommand: `{command}`  \ngit: {git_revision()}  \n"
        f"Device: {device_name(device)}{RANDOM_NOTE if args.random else ''}"
        f"{units}.  \n"
        f"Base point: `{base}`; layers {layers}; fit {fit.describe()}; held-out {held.describe()}.\n"
        f"Mean over layers of the held-out relative error (lower is better) and seconds per layer{runs}:\n\n"
        f"{markdown_table(summary)}\n"))
    print(summary.to_string())


if __name__ == "__main__":
    main()
