"""What is live on the GPU at a prune's peak, and where the host's time goes: one prune of a random-weight
checkpoint (bench/common.py's, no model files needed) under ``torch.cuda.memory._record_memory_history`` and
cProfile. The allocation trace is replayed to the moment of the highest total; the allocations live then are
grouped by the spap_lib / transformers lines that made them.

    python bench/memory_peak.py --model llama-3.1-8b --layers 2 --offload cpu \
        --out bench/results/memory_peak_8b_cpu_h200.txt
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from common import random_calibration, random_checkpoint  # bench/, the script's own folder

import spap_lib as sl
from spap_lib.artifact.manifest import device_name, git_revision
from spap_lib.files import write_text_atomic

GiB = 2**30


def live_at_peak(trace: list[dict]) -> tuple[int, dict]:
    """The highest total of the traced allocations and those live at that moment."""
    live, total, peak, at_peak = {}, 0, 0, {}
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            total += e["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif e["action"] == "free_requested" and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
    return peak, at_peak


def made_by(e: dict) -> str:
    frames = [f for f in e.get("frames", []) if "spap_lib" in f["filename"] or "transformers" in f["filename"]]
    return " < ".join(f"{f['filename'].split('/')[-1]}:{f['line']}:{f['name']}" for f in frames[:4]) or "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--offload", default="cpu")
    ap.add_argument("--method", default="spap")
    ap.add_argument("--sparsity", type=float, default=0.2)
    ap.add_argument("--nsamples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    device = torch.device("cuda")
    path = random_checkpoint(a.model, a.layers, device)
    loaded = sl.load(str(path), device="cuda", offload=a.offload, spill_dir=str(a.out.parent))
    calib = random_calibration(loaded.model.config.vocab_size, a.nsamples, a.seqlen, seed=0)
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    torch.cuda.reset_peak_memory_stats()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    sl.prune(loaded, calib, a.method, a.sparsity, progress=False)
    prof.disable()
    wall = time.perf_counter() - t0
    trace = torch.cuda.memory._snapshot()["device_traces"][0]
    torch.cuda.memory._record_memory_history(enabled=None)
    peak, at_peak = live_at_peak(trace)
    by: Counter[str] = Counter()
    for e in at_peak.values():
        by[made_by(e)] += e["size"]
    lines = [f"Command: python bench/memory_peak.py {' '.join(sys.argv[1:])}", f"Revision: {git_revision()}",
             f"Device: {device_name(device)}; {a.model} with random weights, {a.layers} layers, offload={a.offload}, "
             f"{a.method} at {a.sparsity}, {a.nsamples} x {a.seqlen} random tokens",
             f"prune {wall:.1f} s; max allocated {torch.cuda.max_memory_allocated() / GiB:.3f} GiB; traced peak "
             f"{peak / GiB:.3f} GiB (allocations older than the prune are not traced)", "",
             "Live at the traced peak, by the lines that allocated it:"]
    lines += [f"{v / GiB:8.3f} GiB  {k}" for k, v in sorted(by.items(), key=lambda kv: -kv[1])[:25]]
    for order, restrict in (("tottime", 35), ("cumulative", "spap_lib")):
        s = io.StringIO()
        stats = pstats.Stats(prof, stream=s).sort_stats(order)
        stats.print_stats(restrict) if isinstance(restrict, int) else stats.print_stats(restrict, 40)
        lines.append(s.getvalue())
    write_text_atomic(a.out, "\n".join(lines))
    print("\n".join(lines[:40]))


if __name__ == "__main__":
    main()
