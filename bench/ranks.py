"""One prune on this CPU as 2 ranks × 1 thread (torchrun, gloo) against 1 process × 2 threads, side by side.

    python bench/ranks.py [--model smollm2-135m --method fasp --nsamples 16 --seqlen 256 --repeats 1]

Each configuration runs ``spap prune … --no-eval`` in its own processes, alternating, and is timed whole (start,
load and save included) by GNU time, which also gives the peak resident memory of its largest process (a rank).
The prune's own seconds come from the manifest. Rows go to ``bench/results/ranks_cpu.csv`` as they finish.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "ranks_cpu.csv"
SETUPS = {"1 rank x 2 threads": (1, 2), "2 ranks x 1 thread": (2, 1)}


def run(setup: str, a, out: Path) -> dict:
    ranks, threads = SETUPS[setup]
    prune = ["-m", "spap_lib.cli", "prune", a.model, "--out", str(out), "--method", a.method, "--nsamples",
             str(a.nsamples), "--seqlen", str(a.seqlen), "--no-eval", "--device", "cpu"]
    launch = [sys.executable, *(["-m", "torch.distributed.run", "--nproc-per-node", str(ranks)] if ranks > 1 else []),
              *prune]
    timing = out.with_suffix(".time")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    subprocess.run(["/usr/bin/time", "-f", "%e %M", "-o", str(timing), *launch], check=True, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wall, rss_kb = timing.read_text().split()[-2:]
    manifest = json.loads((out / "spap_manifest.json").read_text())
    return {"setup": setup, "model": a.model, "method": a.method, "tokens": a.nsamples * a.seqlen,
            "wall_s": float(wall), "prune_s": round(manifest["seconds"], 1),
            "peak_rss_gb_largest_process": round(int(rss_kb) / 1e6, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--method", default="fasp")
    ap.add_argument("--nsamples", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=1)
    a = ap.parse_args()
    RESULTS.parent.mkdir(exist_ok=True)
    new = not RESULTS.exists()
    with tempfile.TemporaryDirectory() as tmp, open(RESULTS, "a", newline="") as f:
        writer = None
        for r in range(a.repeats):
            for setup in SETUPS:
                row = run(setup, a, Path(tmp) / f"{r}-{setup.replace(' ', '_')}")
                print(row, flush=True)
                if writer is None:
                    writer = csv.DictWriter(f, fieldnames=list(row))
                    if new:
                        writer.writeheader()
                writer.writerow(row)
                f.flush()


if __name__ == "__main__":
    main()
