"""03_ablate's grid run through papermill one cell after another (``workers`` 0) and as local submitit jobs
(``workers`` 2), one after the other, each into a fresh run folder: wall time, the largest process's peak
resident set (GNU time's), and every row's perplexity side by side.

    python bench/grid_jobs.py --config configs/smoke.yaml --workers 2 --out bench/results/grid_jobs_cpu.csv
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

from spap_lib.artifact.figures import markdown_table
from spap_lib.artifact.manifest import git_revision
from spap_lib.files import REPO, write_csv_atomic, write_text_atomic

KEY = ["model", "label", "sparsity", "eval_seqlen"]


def grid(config: Path, workers: int, folder: Path) -> tuple[float, float, pd.DataFrame]:
    """One papermill run of 03 with ``workers``: seconds, the largest process's peak RSS in GB, its rows."""
    params = folder / "03_ablate.yaml"
    params.write_text(subprocess.run([sys.executable, "-m", "spap_lib.nbparams", str(config),
                                      "notebooks/03_ablate.ipynb"], check=True, capture_output=True, text=True,
                                     cwd=REPO).stdout)
    timing = folder / "time.txt"
    t = time.perf_counter()
    subprocess.run(["/usr/bin/time", "-o", str(timing), "-f", "%M", sys.executable, "-m", "papermill",
                    "notebooks/03_ablate.ipynb", str(folder / "out.ipynb"), "-f", str(params), "-p", "workers",
                    str(workers), "-p", "run_dir", str(folder / "run"), "--log-level", "ERROR"],
                   check=True, cwd=REPO, capture_output=True)
    seconds = time.perf_counter() - t
    rows = pd.read_csv(folder / "run" / "ablation.csv")
    return seconds, int(timing.read_text().split()[-1]) / 2**20, rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/smoke.yaml")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default="bench/results/grid_jobs_cpu.csv")
    args = ap.parse_args(argv)
    runs = {}
    for workers in (0, args.workers):
        with tempfile.TemporaryDirectory(prefix="spap-grid-") as tmp:
            runs[workers] = grid(Path(args.config).resolve(), workers, Path(tmp))
    (s0, m0, a), (s1, m1, b) = runs[0], runs[args.workers]
    rows = a[KEY + ["ppl"]].merge(b[KEY + ["ppl"]], on=KEY, suffixes=(" workers 0", f" workers {args.workers}"))
    rows["relative difference"] = (rows.iloc[:, -1] / rows.iloc[:, -2] - 1).round(6)
    write_csv_atomic(Path(args.out), rows)
    command = " ".join(["python", "bench/grid_jobs.py", *(sys.argv[1:] if argv is None else argv)])
    write_text_atomic(Path(args.out).with_suffix(".md"), (
        "# 03_ablate in one kernel and as local jobs (measured)\n\n"
        f"Command: `{command}`  \nRevision: `{git_revision()}`  \n"
        f"workers 0: {s0:.1f} s, largest process {m0:.2f} GB; workers {args.workers}: {s1:.1f} s, largest process "
        f"{m1:.2f} GB (GNU time's maximum resident set; papermill, the kernel and the jobs included).\n\n"
        + markdown_table(rows, index=False) + "\n"))
    print(f"workers 0 {s0:.1f} s, workers {args.workers} {s1:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
