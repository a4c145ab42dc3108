"""02_prune's flow under offload none / cpu / disk, one process per mode.

Each mode runs in a fresh process (so its peak resident set is its own): plan, load, dense
perplexity, prune, pruned perplexity, save with the reload check. Recorded per mode: the plan's
predicted peaks, the measured ones (host VmHWM of the whole process; CUDA max allocated), load /
prune / evaluation / save seconds, a hash of the kept channels (equal across modes = same prune),
and both perplexities. Rows are appended to ``--out`` as they finish (resumable: done rows are kept).

    python bench/offload.py --model smollm2-135m --modes none,cpu,disk --nsamples 32 --seqlen 512
    python bench/offload.py --model gemma3-270m --modes none,disk --load-only --out bench/results/offload_load_cpu.csv

``--load-only`` stops after loading (weights, tokenizer, calibration windows): the host peak of reading a
model in each mode, in seconds rather than a prune's minutes.

``--random`` saves a checkpoint of a shipped config's shapes with random weights (``--layers`` decoder
layers; bench/.cache, once) and calibrates on random tokens: memory and time of paper-size layers
where the real weights cannot be had (no hub); perplexity is then meaningless and not reported.
``--random --like GGUF`` writes those random weights as a GGUF instead, with the metadata (vocabulary,
tokenizer) of a real GGUF file or alias: the run then loads, tokenizes, calibrates on WikiText-2, evaluates
and saves as a real GGUF source makes it, at the shapes of ``--model``:

    python bench/offload.py --model qwen2.5-1.5b --random --layers 28 --like qwen2.5-coder-0.5b --modes disk \
        --method fasp --nsamples 16 --seqlen 512 --eval-windows 2 --device cpu
"""
from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch
from common import random_calibration, random_checkpoint, random_gguf  # bench/, the script's own folder

import spap_lib as sl
from spap_lib.artifact.figures import markdown_table
from spap_lib.artifact.manifest import device_name, git_revision
from spap_lib.files import write_csv_atomic, write_text_atomic
from spap_lib.numerics.memory import process_peak_rss_mb
from spap_lib.plan import available_host_gb, local_device, plan

GB = 2**30


def one(args) -> dict:
    """One mode, in this process."""
    device = sl.model.loading.pick_device(args.device)
    hparams = json.loads(args.hparams)
    row_name, memory_gb = local_device(device)
    t0 = time.perf_counter()
    source = random_source(args, device)
    tokens = args.random and not args.like  # random tokens: no tokenizer of the model's own
    evaluated = dict(eval_seqlen=2, eval_windows=1) if tokens else \
        dict(eval_seqlen=args.eval_seqlen, eval_windows=args.eval_windows)  # random weights: no perplexity
    p = plan(source, method=args.method, hparams=hparams, nsamples=args.nsamples, seqlen=args.seqlen,
             device=row_name, offload=args.offload, **evaluated)
    spill = tempfile.mkdtemp(prefix="spap-bench-")
    loaded = sl.load(source, device=args.device, offload=args.offload, spill_dir=spill)
    if tokens:
        calib = random_calibration(loaded.model.config.vocab_size, args.nsamples, args.seqlen, seed=0)
    else:
        calib = sl.calibration_windows(loaded.tokenizer, args.nsamples, args.seqlen, 0)
    t_load = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    like = f", the metadata of {args.like}" if args.like else ""
    result = {"model": args.model + (f" (random weights, {args.layers} layers{like})" if args.random else ""),
              "offload": args.offload, "method": args.method, "hparams": json.dumps(hparams),
              "calibration": f"{args.nsamples} x {args.seqlen}", "device": device_name(device),
              "load s": round(t_load, 1), "peak host GB after load": round(process_peak_rss_mb() / 1024, 3)}
    if args.load_only:
        return result
    if not tokens:
        t = time.perf_counter()
        dense = sl.perplexity(loaded.model, loaded.tokenizer, args.eval_seqlen, args.eval_windows, progress=False,
                              onloader=loaded.onloader)
        result["dense ppl"], result["dense eval s"] = round(dense["ppl"], 4), round(time.perf_counter() - t, 1)
    report = sl.prune(loaded, calib, args.method, args.sparsity, hparams=hparams, progress=False)
    result["prune s"] = round(report["seconds"], 1)
    result["kept hash"] = hashlib.sha256(json.dumps(report["kept_channels"]).encode()).hexdigest()[:12]
    if not tokens:
        t = time.perf_counter()
        pruned = sl.perplexity(loaded.model, loaded.tokenizer, args.eval_seqlen, args.eval_windows, progress=False,
                               onloader=loaded.onloader)
        result["pruned ppl"], result["pruned eval s"] = round(pruned["ppl"], 4), round(time.perf_counter() - t, 1)
        t = time.perf_counter()
        out = Path(tempfile.mkdtemp(prefix="spap-bench-out-")) / "pruned"
        sl.save(loaded, report, out)
        checks = sl.artifact.manifest.read_checkpoint_manifest(out)["checks"]
        result["save s"], result["reload max |diff|"] = round(time.perf_counter() - t, 1), checks["reload_max_abs_diff"]
    result["peak host GB (measured, whole run)"] = round(process_peak_rss_mb() / 1024, 3)
    result["peak host GB (plan)"] = round(p.peak_host_gb, 3)
    if device.type == "cuda":
        result["peak device GB (measured, from prune on)"] = round(torch.cuda.max_memory_allocated(device) / GB, 3)
    result["peak device GB (plan)"] = round(p.peak_device_gb, 3)
    result["plan prune s"] = round(p.prune_seconds, 1)
    return result


def random_source(args, device: torch.device) -> str:
    """The model ``one`` loads: ``--model`` itself, or its random-weight checkpoint or GGUF (written once)."""
    if not args.random:
        return args.model
    if args.like:
        return str(random_gguf(args.model, args.layers, args.like))
    return str(random_checkpoint(args.model, args.layers, device))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--modes", default="none,cpu,disk")
    ap.add_argument("--offload", help=argparse.SUPPRESS)  # set for the child process of one mode
    ap.add_argument("--method", default="spap")
    ap.add_argument("--sparsity", type=float, default=0.2)
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--eval-seqlen", type=int, default=512)
    ap.add_argument("--eval-windows", type=int, default=40)
    ap.add_argument("--hparams", default="{}")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--random", action="store_true", help="random weights from the shipped config (no download)")
    ap.add_argument("--layers", type=int, default=2, help="with --random: decoder layers to build")
    ap.add_argument("--like", help="with --random: write a GGUF with this real GGUF's metadata (alias or path)")
    ap.add_argument("--load-only", action="store_true", help="stop after loading: the host peak of reading the model")
    ap.add_argument("--out", default="bench/results/offload.csv")
    args = ap.parse_args(argv)
    if args.offload:  # child: one mode, result as JSON on the last line
        print(json.dumps(one(args)), flush=True)
        return
    if args.random:  # written once, before the children measure their own peaks
        random_source(args, sl.model.loading.pick_device(args.device))
    command = " ".join(["python", "bench/offload.py", *(sys.argv[1:] if argv is None else argv)])
    out = Path(args.out)
    table = pd.read_csv(out) if out.is_file() else pd.DataFrame()
    for mode in args.modes.split(","):
        child = [sys.executable, __file__, *(sys.argv[1:] if argv is None else argv), "--offload", mode]
        proc = subprocess.run(child, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"offload={mode} failed")
        row = json.loads(proc.stdout.strip().splitlines()[-1])
        row["host RAM available GB"] = round(available_host_gb() or 0, 1)
        row["revision"] = git_revision()
        table = pd.concat([table, pd.DataFrame([row])], ignore_index=True)
        write_csv_atomic(out, table)
        print(row, flush=True)
    write_text_atomic(out.with_suffix(".md"), (
        "# 02_prune's flow under each offload (measured)\n\n"
        f"Command: `{command}`  \nRevision: `{git_revision()}`  \n"
        "One process per mode. Host peak: VmHWM of the whole process (load, evaluation, prune, save); device "
        "peak: torch.cuda.max_memory_allocated from the prune on. Plan: `spap_lib.plan` for the same run "
        "(predicted from the config alone). 'kept hash': sha256 of the kept channels (equal = same prune).\n\n"
        + markdown_table(table, index=False) + "\n"))


if __name__ == "__main__":
    sys.exit(main())
