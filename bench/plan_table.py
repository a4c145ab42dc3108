"""The plan's predictions for the paper's models and the 70B-class aliases.

Predicted, not measured: the offload the plan picks (offload="auto": the fastest that fits the card
and a 64 GB host), its peak device and host memory, the disk a disk offload writes, and the time
from throughput.json (the H100 row measured on an H100, its pipeline terms fitted to measured layers; the
RTX 4090 row a spec-sheet assumption) at the paper's 128 x 2048 calibration tokens, SPAP defaults, whole-test-split
perplexity, bf16 weights; precision "auto" (tf32 on CUDA) and float64.

    python bench/plan_table.py
"""
from __future__ import annotations

import sys

import pandas as pd

from spap_lib.artifact.figures import markdown_table
from spap_lib.artifact.manifest import git_revision
from spap_lib.files import write_csv_atomic, write_text_atomic
from spap_lib.plan import THROUGHPUT, plan

HOST_GB = 64
MODELS = ["qwen2.5-0.5b", "llama-3.2-1b", "llama-3.1-8b", "qwen2.5-7b", "llama-3.1-70b", "qwen2.5-72b"]


def main() -> None:
    rows = []
    for model in MODELS:
        for device in ("rtx4090", "h100"):
            for precision in ("auto", "float64"):
                p = plan(model, hparams={"precision": precision}, nsamples=128, seqlen=2048, device=device,
                         host_memory_gb=HOST_GB, offload="auto")
                rows.append({"model": model, "device": f"{device} ({THROUGHPUT[device]['memory_gb']} GB)",
                             "precision": precision, "offload (auto)": p.offload,
                             "peak device GB": round(p.peak_device_gb, 2), "peak host GB": round(p.peak_host_gb, 2),
                             "disk GB": round(p.disk_gb, 1), "fits": "yes" if p.fits else "no",
                             "time": f"{p.total_seconds / 60:.0f} min",
                             "largest stage": max(p.seconds, key=p.seconds.get)})
    frame = pd.DataFrame(rows)
    write_csv_atomic("bench/results/plan_paper_models.csv", frame)
    write_text_atomic("bench/results/plan_paper_models.md", (
        "# The plan for the paper's models (PREDICTED, not measured)\n\n"
        f"Command: `python bench/plan_table.py`  \nRevision: `{git_revision()}`  \n"
        "SPAP defaults (precision auto = tf32 on CUDA, and float64), 128 x 2048 calibration tokens, perplexity "
        f"on the whole WikiText-2 test split at 2048, bf16 weights, a {HOST_GB} GB host; offload auto (the "
        "fastest of none, cpu, disk that fits). Rates: spap_lib/throughput.json (h100 measured on an H100, "
        "its pipeline terms fitted to measured layers, bench/results/plan_times.md; rtx4090 a spec-sheet "
        "assumption without them).\n\n"
        + markdown_table(frame, index=False) + "\n"))
    print(frame.to_string(index=False))


if __name__ == "__main__":
    sys.exit(main())
