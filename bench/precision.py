"""float32 vs float64 Gram sums and solves: same kept channels? same perplexity?

For each model, SPAP (or another solving method) prunes a fresh copy of the dense model with each
``precision`` on the grid's protocol (32 x 512 validation calibration windows, seed 0; perplexity on
the first 40 test windows of 512), records prune time, perplexity and the kept channels, and compares
every precision with float64: channels that differ per layer, and the relative perplexity change.
Resumable: a (model, precision) already in the CSV is not rerun; the table is rewritten after each.

    python bench/precision.py --models smollm2-135m,gemma3-270m --precisions float64,float32
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

import spap_lib as sl
from spap_lib.artifact.figures import markdown_table
from spap_lib.artifact.manifest import git_revision
from spap_lib.evaluation.data import tokenize
from spap_lib.files import write_csv_atomic, write_text_atomic


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m")
    ap.add_argument("--precisions", default="float64,float32")
    ap.add_argument("--method", default="spap")
    ap.add_argument("--sparsity", type=float, default=0.2)
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--eval-seqlen", type=int, default=512)
    ap.add_argument("--eval-windows", default="40", help="per model, e.g. 40 or smollm2-135m=40,gemma3-270m=10")
    ap.add_argument("--out", default="bench/results/precision.csv")
    args = ap.parse_args(argv)
    command = " ".join(["python", "bench/precision.py", *(sys.argv[1:] if argv is None else argv)])
    windows = dict(kv.split("=") for kv in args.eval_windows.split(",")) if "=" in args.eval_windows else {}
    out = Path(args.out)
    table = pd.read_csv(out) if out.is_file() else pd.DataFrame()
    for model in args.models.split(","):
        for precision in args.precisions.split(","):
            if not table.empty and ((table["model"] == model) & (table["precision"] == precision)).any():
                continue
            loaded = sl.load(model, device="cpu")
            calib = sl.calibration_windows(loaded.tokenizer, args.nsamples, args.seqlen, 0)
            report = sl.prune(loaded, calib, args.method, args.sparsity, hparams={"precision": precision})
            ids = tokenize(loaded.tokenizer, sl.wikitext("test").text)
            n = int(windows.get(model, args.eval_windows if not windows else 40))
            ppl = sl.perplexity_of_ids(loaded.model, ids, args.eval_seqlen, n)
            row = {"model": model, "method": args.method, "precision": precision, "sparsity": args.sparsity,
                   "ppl": ppl["ppl"], "eval_seqlen": args.eval_seqlen, "eval_windows": ppl["windows"],
                   "prune_seconds": report["seconds"], "nsamples": args.nsamples, "seqlen": args.seqlen,
                   "kept_channels": json.dumps(report["kept_channels"])}
            table = pd.concat([table, pd.DataFrame([row])], ignore_index=True)
            write_csv_atomic(out, table)
            print(model, precision, f"ppl {ppl['ppl']:.3f}", f"{report['seconds']:.0f} s", flush=True)
            del loaded
    rows = []
    for model, part in table.groupby("model", sort=False):
        ref = part[part["precision"] == "float64"]
        for _, r in part.iterrows():
            diff = None
            if len(ref):
                a, b = json.loads(ref.iloc[0]["kept_channels"]), json.loads(r["kept_channels"])
                diff = [len(set(x) - set(y)) for x, y in zip(a, b)]
            rows.append({"model": model, "precision": r["precision"], "ppl": round(r["ppl"], 3),
                         "ppl vs float64": f"{r['ppl'] / ref.iloc[0]['ppl'] - 1:+.3%}" if len(ref) else "",
                         "layers with other channels": sum(d > 0 for d in diff) if diff else "",
                         "channels differing (all layers)": sum(diff) if diff else "",
                         "prune s": round(r["prune_seconds"]), "eval windows": r["eval_windows"]})
    write_text_atomic(out.with_suffix(".md"), (
        f"# Gram/solve precision: float32 vs float64\n\nCommand: `{command}`  \nRevision: `{git_revision()}`  \n"
        f"Method {args.method} at {args.sparsity}, {args.nsamples} x {args.seqlen} calibration tokens (validation, "
        f"seed 0), perplexity on the first windows of {args.eval_seqlen} tokens of WikiText-2 test; 2-core CPU, "
        f"float32 weights.\n\n{markdown_table(pd.DataFrame(rows), index=False)}\n"))


if __name__ == "__main__":
    main()
