"""Does the penalty loop's early end (``patience``) keep Alg. 1's channels? Every layer, several sparsities.

For each decoder layer of a model (dense model, calibration windows as in the grid, inputs propagated through the
dense layers) and each sparsity, the penalty method runs its K iterations (``patience=0``, Alg. 1) and with the
early end, on the same Gram matrix; the table says how many iterations each ran, how many removed channels moved
after the first s-step, and whether the two kept the same channels (and so the same refit, to the bit).

    python bench/patience.py --model smollm2-135m --sparsities 0.1 0.3 0.5
"""
from __future__ import annotations

import argparse
import sys
import time

import pandas as pd
import torch

import spap_lib as sl
from spap_lib.artifact.figures import markdown_table
from spap_lib.artifact.manifest import git_revision
from spap_lib.files import write_csv_atomic, write_text_atomic
from spap_lib.model.capture import first_layer_inputs, replay
from spap_lib.numerics.linalg import chunk_for, gram


def run(method, mlp, H: torch.Tensor, n_remove: int) -> tuple[torch.Tensor, torch.Tensor, dict, float]:
    t0 = time.perf_counter()
    keep, W, info = method.penalty(mlp, H, n_remove)
    return keep, W, info, time.perf_counter() - t0


@torch.no_grad()
def compare(model: str, sparsities: list[float], nsamples: int, seqlen: int, patience: int,
            every: int) -> pd.DataFrame:
    loaded = sl.load(model, device="cpu")
    calib = sl.calibration_windows(loaded.tokenizer, nsamples, seqlen, 0)
    layers = loaded.adapter.layers()
    hidden, kwargs = first_layer_inputs(loaded.model, layers, calib.windows, 1, loaded.device)
    alg1, early = sl.get_method("spap", patience=0), sl.get_method("spap", patience=patience)
    plans = {s: sl.plan_sparsity(loaded.adapter, s) for s in sparsities}
    rows = []
    for i, layer in enumerate(layers):
        hidden, X = replay(layer, hidden, {b: kw[i] for b, kw in kwargs.items()}, 1,
                           watch=loaded.adapter.mlp_input_module(layer))
        if i % every:
            continue
        mlp = loaded.adapter.get_mlp(layer)
        H = gram(mlp, X, chunk_for(mlp.width, 8192), dtype=torch.float32)
        for s, plan in plans.items():
            keep0, W0, info0, t0 = run(alg1, mlp, H, plan.n_remove)
            keep1, W1, info1, t1 = run(early, mlp, H, plan.n_remove)
            rows.append({"layer": i, "sparsity": s, "iterations (Alg. 1)": info0["iterations"],
                         f"iterations (patience={patience})": info1["iterations"], "moved": info0["moved"],
                         "same kept channels": torch.equal(keep0, keep1), "same refit": torch.equal(W0, W1),
                         "seconds (Alg. 1)": t0, f"seconds (patience={patience})": t1})
            print(rows[-1], flush=True)
    return pd.DataFrame(rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--sparsities", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.5])
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--patience", type=int, default=3)
    ap.add_argument("--every", type=int, default=1, help="every this many layers (1: all)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    out = args.out or f"bench/results/patience_{args.model}.csv"
    command = " ".join(["python", "bench/patience.py", *(sys.argv[1:] if argv is None else argv)])
    frame = compare(args.model, args.sparsities, args.nsamples, args.seqlen, args.patience, args.every)
    write_csv_atomic(out, frame)
    by = frame.groupby("sparsity").agg(
        layers=("layer", "count"), same_kept=("same kept channels", "sum"), same_refit=("same refit", "sum"),
        moved_layers=("moved", lambda m: int((m > 0).sum())),
        iterations=(f"iterations (patience={args.patience})", "mean"),
        seconds_alg1=("seconds (Alg. 1)", "sum"), seconds_early=(f"seconds (patience={args.patience})", "sum"))
    write_text_atomic(out.replace(".csv", ".md"), (
        f"# The penalty loop's early end against Alg. 1's K iterations\n\nCommand: `{command}`  \n"
        f"Revision: `{git_revision()}`  \nModel {args.model}, {args.nsamples} x {args.seqlen} calibration tokens "
        f"(dense inputs), float32 Gram matrices, SPAP's defaults otherwise; `moved_layers`: layers where a removed "
        f"channel differs from the first s-step's choice; `iterations`: the mean the early end ran.\n\n"
        f"{markdown_table(by)}\n"))
    print(by.to_string())


if __name__ == "__main__":
    main()
