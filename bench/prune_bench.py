"""Prune a real model at several sparsities; record perplexity, pruning time and achieved sparsity.

    python bench/prune_bench.py --model smollm2-135m --sparsities 0.1,0.2,0.3 \\
        --nsamples 32 --seqlen 512 --eval-seqlens 2048,512 --out bench/results/smollm2_spap.csv

Every sparsity starts from a freshly loaded dense model and uses the same calibration windows.
The table is rewritten atomically after every model, with a Markdown twin that records the command,
git revision, machine and protocol.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import pandas as pd
import torch

import spap_lib as sl
from spap_lib.data import tokenize
from spap_lib.io import git_revision, versions, write_csv_atomic, write_text_atomic


def _windows(arg: str) -> int | None:
    return None if arg in ("all", "none", "None") else int(arg)


def write_results(args, command: str, revision: str | None, calib, hparams: dict, rows: list[dict]) -> None:
    """The CSV and its Markdown twin (command, git, machine, protocol), rewritten after every model."""
    frame = pd.DataFrame(rows)
    write_csv_atomic(args.out, frame)
    table = frame.pivot_table(index=["method", "sparsity"], columns="eval_seqlen", values="ppl").round(2)
    write_text_atomic(args.out.replace(".csv", ".md"), (
        f"# {args.model}: {args.method} at {args.sparsities}\n\n"
        f"Command: `{command}`  \ngit: {revision}  \nmachine: {platform.machine()}, "
        f"{torch.get_num_threads()} threads, cuda={torch.cuda.is_available()}  \nversions: {versions()}  \n"
        f"Calibration: {calib.describe()}  \nMethod hyperparameters: {sl.get_method(args.method, **hparams).hparams()}  \n"
        f"Evaluation: WikiText-2 raw test, non-overlapping windows, cap {args.eval_windows or 'none (whole split)'}\n\n"
        f"## Perplexity\n\n{table.to_markdown()}\n\n## All columns\n\n{frame.round(4).to_markdown(index=False)}\n"))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--method", default="spap")
    ap.add_argument("--sparsities", default="0.1,0.2,0.3")
    ap.add_argument("--nsamples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-seqlens", default="2048,512")
    ap.add_argument("--eval-windows", type=_windows, default=None, help="cap per eval seqlen; 'all' = whole test split")
    ap.add_argument("--hparams", default="{}", help="JSON overrides of the method's defaults")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default="bench/results/smollm2_spap.csv")
    args = ap.parse_args(argv)
    command = " ".join(["python", "bench/prune_bench.py", *(sys.argv[1:] if argv is None else argv)])
    revision = git_revision()  # the code this run imported, even if the tree changes while it runs
    hparams = json.loads(args.hparams)
    sl.get_method(args.method, **hparams)  # fail before loading anything

    loaded = sl.load(args.model, device=args.device)
    ids = tokenize(loaded.tokenizer, sl.wikitext("test").text)
    calib = sl.calibration_windows(loaded.tokenizer, args.nsamples, args.seqlen, args.seed)
    eval_seqlens = [int(s) for s in args.eval_seqlens.split(",")]
    rows = []

    def evaluate(label: dict, extra: dict) -> None:
        for seqlen in eval_seqlens:
            t0 = time.perf_counter()
            ppl = sl.perplexity_of_ids(loaded.model, ids, seqlen, args.eval_windows)
            rows.append({**label, "eval_seqlen": seqlen, "eval_windows": ppl["windows"],
                         "eval_all_windows": ppl["all_windows"], "ppl": ppl["ppl"],
                         "eval_seconds": time.perf_counter() - t0, **extra})
            print(json.dumps(rows[-1]), flush=True)
        write_results(args, command, revision, calib, hparams, rows)

    counts = sl.param_counts(loaded)
    base = {"model": args.model, "calib_nsamples": args.nsamples, "calib_seqlen": args.seqlen,
            "calib_split": calib.split, "seed": args.seed}
    evaluate({**base, "method": "dense", "sparsity": 0.0},
             {"achieved_decoder": 0.0, "achieved_total": 0.0, "decoder_params": counts["decoder"],
              "total_params": counts["total"], "prune_seconds": 0.0})
    for sparsity in [float(s) for s in args.sparsities.split(",")]:
        loaded = sl.load(args.model, device=args.device)  # fresh dense weights for every sparsity
        report = sl.prune(loaded, calib, args.method, sparsity, hparams=hparams, seed=args.seed)
        evaluate({**base, "method": args.method, "sparsity": sparsity},
                 {"achieved_decoder": report["sparsity"]["achieved_decoder"],
                  "achieved_total": report["sparsity"]["achieved_total"],
                  "decoder_params": report["params"]["pruned"]["decoder"],
                  "total_params": report["params"]["pruned"]["total"], "prune_seconds": report["seconds"]})


if __name__ == "__main__":
    main()
