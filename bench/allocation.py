"""What the error allocation's dense pass costs, stage by stage, and its curves taken three ways side by side.

One pass through the dense layers, as ``pipeline.dense_stats`` makes it for ``allocation="error"``: each layer's
replay, then its channel statistics and its error curve (``SPAP.error_curve``), taken three ways on the same layer in
rotating order:

* "one pass" (the library's): the curve's Gram pass sums the channel statistics from its own ``Z``;
* "nested": a pass of their own for the statistics (``ChannelStats.of``), then the curve given them;
* "per set": the same statistics, and one solve and one Gram-statistics error per curve point (``per_set_errors``
  below) instead of every point's refit from one factorisation (``linalg.nested_lstsq_errors``).

The statistics and curves of the first two must be equal; the per-layer widths that each set of curves gives at every
sparsity are compared. Writes a CSV and its Markdown twin.

    python bench/allocation.py --model smollm2-135m --nsamples 32 --seqlen 512
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
from spap_lib.methods.parts import allocation as alloc
from spap_lib.methods.spap import curves as spap_mod  # where the error curve calls nested_lstsq_errors
from spap_lib.model.capture import first_layer_inputs, replay
from spap_lib.numerics.linalg import chunk_for, token_energies
from spap_lib.numerics.solve import lstsq_columns, reconstruction_error
from spap_lib.numerics.stats import ChannelStats


def per_set_errors(WH, H, order, sizes, delta, YY, toward=None, pull=0.0) -> list[float]:
    """The reference: ``lstsq_columns`` on each kept set, its error from the Gram statistics (one factorisation and
    one float64 quadratic form per point)."""
    errors = []
    for k in sizes:
        cols = torch.sort(order[:k]).values
        W = lstsq_columns(WH, H, cols, delta, toward=toward, pull=pull)
        errors.append(reconstruction_error(W, H[cols][:, cols], WH[:, cols], YY))
    return errors


def curve(method, mlp, X, chunk, residual, errors, separate: bool) -> tuple[ChannelStats, list, float]:
    """``method.error_curve`` with the curve points' errors from ``errors``, the statistics from a pass of their own
    where ``separate`` (else from the curve's); and its seconds."""
    library = spap_mod.nested_lstsq_errors
    spap_mod.nested_lstsq_errors = errors
    try:
        t0 = time.perf_counter()
        stats = ChannelStats.of(mlp, X, chunk) if separate else None
        stats, points = method.error_curve(mlp, X, chunk, residual, stats)
        return stats, points, time.perf_counter() - t0
    finally:
        spap_mod.nested_lstsq_errors = library


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--method", default="spap/allocation=error")
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--sparsities", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.4, 0.5])
    ap.add_argument("--out", default="bench/results/allocation_smollm2.csv")
    args = ap.parse_args(argv)
    command = " ".join(["python", "bench/allocation.py", *(sys.argv[1:] if argv is None else argv)])
    loaded = sl.load(args.model, device="cpu")
    method = sl.get_method(args.method)
    calib = sl.calibration_windows(loaded.tokenizer, args.nsamples, args.seqlen, 0)
    layers = loaded.adapter.layers()
    hidden, kwargs = first_layer_inputs(loaded.model, layers, calib.windows, 1, loaded.device)
    ways = {"one pass": (spap_mod.nested_lstsq_errors, False), "nested": (spap_mod.nested_lstsq_errors, True),
            "per set": (per_set_errors, True)}
    rows, curves, stats = [], {name: [] for name in ways}, {}
    for i, layer in enumerate(layers):
        t0 = time.perf_counter()
        out, X = replay(layer, hidden, {b: kw[i] for b, kw in kwargs.items()}, 1,
                        watch=loaded.adapter.mlp_input_module(layer))
        mlp = loaded.adapter.get_mlp(layer)
        chunk = chunk_for(mlp.width, 8192)
        residual = token_energies(out.reshape(-1, out.shape[-1]), chunk, loaded.device)
        row = {"layer": i, "replay": time.perf_counter() - t0}
        names = list(ways)
        for name in names[i % 3:] + names[:i % 3]:  # rotate which runs first
            stats[name], points, row[name] = curve(method, mlp, X, chunk, residual, *ways[name])
            curves[name].append(points)
        row["same statistics and curve"] = curves["one pass"][-1] == curves["nested"][-1] and all(
            torch.equal(getattr(stats["one pass"], k), getattr(stats["nested"], k)) for k in ("z_sum", "z_sq"))
        row["largest relative difference"] = max(abs(a - b) / max(abs(b), 1e-30) for (_, a), (_, b)
                                                 in zip(curves["nested"][-1], curves["per set"][-1]))
        rows.append(row)
        print(i, {k: round(v, 3) for k, v in row.items()}, flush=True)
        hidden = out
    widths = []
    for sparsity in args.sparsities:
        plan = sl.plan_sparsity(loaded.adapter, sparsity)
        total = plan.n_remove * len(layers)
        a, b = (alloc.by_error(curves[name], total) for name in ("nested", "per set"))
        widths.append({"sparsity": sparsity, "channels removed": total, "same widths": a == b,
                       "layers that differ": sum(x != y for x, y in zip(a, b)),
                       "channels moved": sum(abs(x - y) for x, y in zip(a, b)) // 2})
    frame = pd.DataFrame(rows)
    frame["model"], frame["tokens"] = args.model, args.nsamples * args.seqlen
    write_csv_atomic(args.out, frame)
    sums = frame[["replay", *ways]].sum()
    write_text_atomic(args.out.replace(".csv", ".md"), (
        f"# The error allocation's dense pass\n\nCommand: `{command}`  \nRevision: `{git_revision()}`  \n"
        f"Machine: {torch.get_num_threads()} CPU threads; {args.model}, {args.nsamples} x {args.seqlen} calibration "
        f"tokens, `{args.method}`.\n\nSeconds summed over the {len(layers)} layers (each curve's with its channel "
        f"statistics):\n\n{markdown_table(sums.round(2).to_frame('seconds'))}\n\n"
        f"The statistics from the curve's own pass: {sums['nested'] / sums['one pass']:.2f}x as fast as a pass of "
        f"their own; the same statistics and curves in {int(frame['same statistics and curve'].sum())} of "
        f"{len(layers)} layers. The curve's points from one factorisation: {sums['per set'] / sums['nested']:.2f}x "
        f"as fast as one solve per point; the largest relative difference of a curve point "
        f"{frame['largest relative difference'].max():.1e}.\n\nThe widths each set of curves gives:\n\n"
        f"{markdown_table(pd.DataFrame(widths), index=False)}\n"))


if __name__ == "__main__":
    main()
