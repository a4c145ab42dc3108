"""Per-layer held-out error of SPAP's parts: Table 5 under both readings of the paper's budget, and
what the penalty method changes in the mask.

For each chosen decoder layer the dense MLP inputs are captured for the calibration windows (the fit
set, seed 0) and for held-out windows (seed 1, every window overlapping a fit window dropped), as in
``bench/tune.py``. Then, on the same layer problem:

* **variants** (``--variants``, grid labels such as ``spap_gd/am_iters=20,adam_steps=1``): each prunes
  the layer; we record the held-out and calibration relative error ``‖Y − f(X)‖²/‖Y‖²`` and seconds.
* **masks**: the channels removed by the first score step of Alg. 1 (``first``), by the whole penalty
  method (``penalty``, the default top-λ rule, and ``penalty_previous``, Alg. 1's printed threshold
  rule) and by FASP (``fasp``); how many of each set's channels differ from the penalty method's, and
  the held-out error of every mask refitted the same way (least squares on the kept columns, the
  refit ``spap_no_update`` and FASP share), and of FASP's mask with its dense weights (no refit: whether
  the refit helps on held-out tokens or overfits the calibration set).

    python bench/layers.py --model smollm2-135m --layers 2,15,28 --out bench/results/layers_smollm2.csv
"""
from __future__ import annotations

import dataclasses
import sys
import time

import pandas as pd
import torch
from common import layer_bench_parser, mlp_inputs  # bench/, the script's own folder

import spap_lib as sl
from spap_lib.artifact.figures import markdown_table
from spap_lib.artifact.grid import Variant
from spap_lib.artifact.manifest import git_revision
from spap_lib.files import write_csv_atomic, write_text_atomic
from spap_lib.methods import LayerProblem
from spap_lib.methods.parts.selection import column_scores
from spap_lib.methods.spap.penalty import Penalty, penalty_method
from spap_lib.numerics.linalg import mean_diag
from spap_lib.numerics.solve import lstsq_columns

TABLE5 = ("fasp,spap_no_update,spap,spap_gd,"  # equal gradient steps: 10 rounds x 10 Adam steps (defaults)
          "spap/am_iters=20,spap_gd/am_iters=20,"  # the paper's 20 rounds, equal gradient steps (200)
          "spap_gd/am_iters=20,adam_steps=1")  # equal iterations: 20 Adam steps against spap/am_iters=20


def held_out_windows(tokenizer, fit, n: int, seqlen: int):
    """``n`` windows of seed 1 that share no token position with a window of ``fit``."""
    cand = sl.calibration_windows(tokenizer, 4 * n, seqlen, seed=1)
    ok = [i for i, s in enumerate(cand.starts.tolist()) if all(abs(s - f) >= seqlen for f in fit.starts.tolist())]
    if len(ok) < n:
        raise SystemExit(f"only {len(ok)} held-out windows avoid the fit windows; lower --nsamples")
    return dataclasses.replace(cand, windows=cand.windows[ok[:n]], starts=cand.starts[ok[:n]])


def rel_error(mlp, X, Y) -> float:
    with torch.no_grad():
        return float((mlp(X) - Y).pow(2).sum() / Y.pow(2).sum())


def mask_rows(problem: LayerProblem, spap, X_held, Y_held) -> list[dict]:
    """The removed sets of the first score step, the penalty method (both rules) and FASP, each refitted
    by least squares on its kept columns; differences counted against the penalty method's set."""
    dense, H, n, lam = problem.dense, problem.H, problem.dense.width, problem.n_remove
    bias = problem.has_bias
    znorm = torch.diagonal(H)[:n].clamp_min(0).sqrt()
    W0 = dense.out_augmented().to(H.dtype)
    kw = dict(rho0=spap.rho0, tau=spap.tau, t=spap.t, alpha=spap.alpha, K=spap.K, damp=spap.damp)
    removed = {
        "first": set(torch.topk(column_scores(W0[:, :n], znorm, spap.t), lam, largest=False).indices.tolist()),
        "fasp": set(torch.topk(dense.W_out.double().abs().sum(0) * znorm, lam, largest=False).indices.tolist()),
    }
    for name, rule in (("penalty", "top"), ("penalty_previous", "previous")):
        keep, _, _ = penalty_method(W0, H, lam, Penalty(threshold=rule, **kw), bias=bias)
        removed[name] = set(range(n)) - set(keep.tolist())
    rows = []
    for name, gone in [*removed.items(), ("fasp (dense weights, no refit)", removed["fasp"])]:
        keep = torch.tensor(sorted(set(range(n)) - gone), dtype=torch.long)
        cols = torch.cat([keep, keep.new_tensor([n])]) if bias else keep
        mlp = dense.select(keep)
        if "no refit" not in name:  # the refit's own value: held-out error with and without it
            mlp.set_out_augmented(lstsq_columns(W0 @ H, H, cols, spap.damp * mean_diag(H[:n, :n])))
        rows.append({"kind": "mask", "label": name, "differs_from_penalty": len(gone - removed["penalty"]),
                     "differs_from_first": len(gone - removed["first"]), "removed": lam,
                     "heldout_rel_error": rel_error(mlp, X_held, Y_held),
                     "fit_rel_error": rel_error(mlp, problem.X, problem.Y)})
    return rows


def main(argv=None) -> None:
    ap = layer_bench_parser(__doc__)
    ap.add_argument("--held", type=int, default=8, help="held-out windows")
    ap.add_argument("--variants", default=TABLE5, help="comma-separated grid labels; ',' inside a label's "
                    "key=value list is allowed (a part without '/' or '=' starts a new label)")
    ap.add_argument("--no-masks", action="store_true", help="skip the mask comparison")
    ap.add_argument("--held-avoid", type=int, default=None,
                    help="held-out windows avoid the first N seed-0 windows (default --nsamples): give the largest "
                         "--nsamples of a calibration-size study so every size is scored on the same windows (the "
                         "seed-0 windows of a smaller size are the first ones of a larger)")
    ap.add_argument("--out", default="bench/results/layers.csv")
    args = ap.parse_args(argv)
    labels = []
    for part in args.variants.split(","):  # "spap_gd/am_iters=20,adam_steps=1" stays one label
        if labels and "=" in part and "/" not in part:
            labels[-1] += "," + part
        else:
            labels.append(part)
    variants = [Variant.parse(label) for label in labels]  # unknown method or hyperparameter: fail now
    command = " ".join(["python", "bench/layers.py", *(sys.argv[1:] if argv is None else argv)])
    revision = git_revision()

    loaded = sl.load(args.model, device="cpu")
    layers = [int(x) for x in args.layers.split(",")]
    fit = sl.calibration_windows(loaded.tokenizer, args.nsamples, args.seqlen, seed=0)
    avoid = fit if args.held_avoid is None else \
        sl.calibration_windows(loaded.tokenizer, args.held_avoid, args.seqlen, seed=0)
    held = held_out_windows(loaded.tokenizer, avoid, args.held, args.seqlen)
    X_fit, X_held = mlp_inputs(loaded, fit.windows, layers), mlp_inputs(loaded, held.windows, layers)
    n_remove = sl.plan_sparsity(loaded.adapter, args.sparsity).n_remove
    spap = sl.get_method("spap")
    rows = []
    for i in layers:
        dense = loaded.adapter.get_mlp(loaded.adapter.layers()[i])
        Y_held = dense(X_held[i]).detach()
        problem = LayerProblem.of(spap, dense, X_fit[i], n_remove, seed=0, layer_index=i)
        for v in variants:
            t0 = time.perf_counter()
            res = sl.get_method(v.method, **v.hparams).prune(problem)
            rows.append({"layer": i, "kind": "variant", "label": v.label, "seconds": time.perf_counter() - t0,
                         "heldout_rel_error": rel_error(res.mlp, X_held[i], Y_held),
                         "fit_rel_error": rel_error(res.mlp, problem.X, problem.Y), "moved": res.info.get("moved")})
            print(i, v.label, f"{rows[-1]['heldout_rel_error']:.5f}", f"{rows[-1]['seconds']:.1f}s", flush=True)
        if not args.no_masks:
            rows += [{"layer": i, **r} for r in mask_rows(problem, spap, X_held[i], Y_held)]
        write_results(args, command, revision, fit, held, rows)  # after every layer: partial results land


def write_results(args, command, revision, fit, held, rows) -> None:
    frame = pd.DataFrame(rows)
    write_csv_atomic(args.out, frame)
    parts = [f"# Per-layer held-out error: {args.model} at {args.sparsity:.0%}\n\nCommand: `{command}`  \n"
             f"git: {revision}  \nfit {fit.describe()}; held-out {held.describe()} (seed-1 windows that overlap "
             f"no fit window).\nRelative error ‖Y − f(X)‖²/‖Y‖² of the pruned MLP on dense "
             f"inputs (lower is better).\n"]
    for kind, title in (("variant", "Variants (held-out error per layer, mean, calibration error, seconds)"),
                        ("mask", "Masks refitted by least squares (held-out error per layer)")):
        part = frame[frame["kind"] == kind]
        if part.empty:
            continue
        wide = part.pivot_table(index="label", columns="layer", values="heldout_rel_error", sort=False)
        wide.columns = [f"layer {c}" for c in wide.columns]
        wide["mean"] = wide.mean(axis=1)
        wide["fit (mean)"] = part.groupby("label", sort=False)["fit_rel_error"].mean()
        if kind == "variant":
            wide["seconds / layer"] = part.groupby("label", sort=False)["seconds"].mean()
        else:
            wide["differs from penalty (mean of λ)"] = part.groupby("label", sort=False)["differs_from_penalty"].mean()
            wide["differs from first (mean)"] = part.groupby("label", sort=False)["differs_from_first"].mean()
            wide["λ"] = part.groupby("label", sort=False)["removed"].first()
        parts.append(f"\n## {title}\n\n{markdown_table(wide, floatfmt='.5g')}\n")
    write_text_atomic(args.out.replace(".csv", ".md"), "".join(parts))


if __name__ == "__main__":
    main()
