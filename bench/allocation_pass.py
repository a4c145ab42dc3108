"""The dense pass that decides non-uniform widths, with the model's products and with bf16 ones, side by side.

For one allocation (``--method``), ``pipeline.dense_stats`` runs as a prune would run it, alternately with
``allocation_precision`` full and bf16, ``--repeat`` times each, on the same layer-0 inputs; then the per-layer
widths each pass gives at every sparsity are compared. The seconds are each setting's median. Writes a CSV and its
Markdown twin.

    python bench/allocation_pass.py --model smollm2-135m --method spap/allocation=angular --repeat 2
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import pandas as pd
import torch

import spap_lib as sl
from spap_lib.artifact.figures import markdown_table
from spap_lib.artifact.manifest import git_revision
from spap_lib.files import write_csv_atomic, write_text_atomic
from spap_lib.model.capture import first_layer_inputs
from spap_lib.pipeline.sequential import RunSettings, dense_stats

SETTINGS = ("full", "bf16")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--method", default="spap/allocation=angular", help="a label with a non-uniform allocation")
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--sparsities", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.4, 0.5])
    ap.add_argument("--out", default="bench/results/allocation_pass_smollm2.csv")
    args = ap.parse_args(argv)
    command = " ".join(["python", "bench/allocation_pass.py", *(sys.argv[1:] if argv is None else argv)])
    methods = {p: sl.get_method(args.method, allocation_precision=p) for p in SETTINGS}
    if methods["full"].allocation not in ("angular", "error"):
        raise SystemExit(f"--method {args.method!r}: give an angular or error allocation (the widths this bench "
                         "compares come from the pass alone)")
    loaded = sl.load(args.model, device="cpu")
    calib = sl.calibration_windows(loaded.tokenizer, args.nsamples, args.seqlen, 0)
    adapter = loaded.adapter
    inputs = first_layer_inputs(loaded.model, adapter.layers(), calib.windows, 1, loaded.device)
    seconds, stats = {p: [] for p in SETTINGS}, {}
    for r in range(args.repeat):
        for p in SETTINGS if r % 2 == 0 else SETTINGS[::-1]:  # alternate which runs first
            method = methods[p]
            dense = method.dense_pass(True)
            curve = method.error_curve if dense.curves else None
            t0 = time.perf_counter()
            stats[p] = dense_stats(adapter, inputs, curve=curve, channels=dense.channels, in_bf16=dense.bf16,
                                   run=RunSettings(progress=False))
            seconds[p].append(time.perf_counter() - t0)
            print(p, round(seconds[p][-1], 2), flush=True)
    width = adapter.width(adapter.layers()[0])
    rows = []
    for sparsity in args.sparsities:
        total = sl.plan_sparsity(adapter, sparsity).n_remove * len(adapter.layers())
        full, low = (methods[p].removals(stats[p], width, total) for p in SETTINGS)
        rows.append({"sparsity": sparsity, "channels removed": total, "same widths": full == low,
                     "layers that differ": sum(a != b for a, b in zip(full, low)),
                     "channels moved": sum(abs(a - b) for a, b in zip(full, low)) // 2})
    angular = max(abs(a.angular - b.angular) / abs(a.angular) for a, b in zip(stats["full"], stats["bf16"]))
    frame = pd.DataFrame(rows)
    frame["model"], frame["method"], frame["tokens"] = args.model, args.method, args.nsamples * args.seqlen
    for p in SETTINGS:
        frame[f"seconds ({p})"] = statistics.median(seconds[p])
    write_csv_atomic(args.out, frame)
    full, low = (statistics.median(seconds[p]) for p in SETTINGS)
    write_text_atomic(args.out.replace(".csv", ".md"), (
        f"# The allocation's dense pass: the model's products against bf16\n\nCommand: `{command}`  \n"
        f"Revision: `{git_revision()}`  \nMachine: {torch.get_num_threads()} CPU threads; {args.model}, "
        f"{args.nsamples} x {args.seqlen} calibration tokens, `{args.method}`.\n\n"
        f"The pass over the {len(adapter.layers())} layers, median of {args.repeat} runs each (alternating): full "
        f"{full:.1f} s, bf16 {low:.1f} s ({full / low:.2f}x as fast). The largest relative difference of a block's "
        f"angular distance: {angular:.1e}.\n\nThe widths each pass gives:\n\n"
        f"{markdown_table(frame[list(rows[0])], index=False)}\n"))


if __name__ == "__main__":
    main()
