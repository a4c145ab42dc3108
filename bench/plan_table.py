"""The plan's predictions for the paper's models and the 70B-class aliases (issue: scale).

Predicted, not measured: peak device memory with everything resident (offload "none", the only
mode so far) and compute-only time from throughput.json (GPU rows are spec-sheet assumptions) at the
paper's 128 x 2048 calibration tokens, SPAP defaults, whole-test-split perplexity, bf16 weights.

    python bench/plan_table.py
"""
from __future__ import annotations

import sys

import pandas as pd

from spap_lib.io import git_revision, write_csv_atomic, write_text_atomic
from spap_lib.plan import THROUGHPUT, plan

MODELS = ["qwen2.5-0.5b", "llama-3.2-1b", "llama-3.1-8b", "qwen2.5-7b", "llama-3.1-70b", "qwen2.5-72b"]


def main() -> None:
    rows = []
    for model in MODELS:
        for device in ("rtx4090", "h100"):
            for precision in ("float64", "float32"):
                p = plan(model, hparams={"precision": precision}, nsamples=128, seqlen=2048, device=device)
                rows.append({"model": model, "device": f"{device} ({THROUGHPUT[device]['memory_gb']} GB)",
                             "precision": precision, "weights GB": round(p.memory_gb["weights"], 2),
                             "peak device GB": round(p.peak_device_gb, 2), "fits": "yes" if p.fits else "no",
                             "time (compute only)": f"{p.total_seconds / 60:.0f} min",
                             "largest stage": max(p.seconds, key=p.seconds.get)})
    frame = pd.DataFrame(rows)
    write_csv_atomic("bench/results/plan_paper_models.csv", frame)
    write_text_atomic("bench/results/plan_paper_models.md", (
        "# The plan for the paper's models (PREDICTED, not measured)\n\n"
        f"Command: `python bench/plan_table.py`  \nRevision: `{git_revision()}`  \n"
        "SPAP defaults, 128 x 2048 calibration tokens, perplexity on the whole WikiText-2 test split at 2048, "
        "bf16 weights, everything resident on the device (offload none). GPU rates are spec-sheet assumptions "
        "(spap_lib/throughput.json).\n\n" + frame.to_markdown(index=False) + "\n"))
    print(frame.to_string(index=False))


if __name__ == "__main__":
    sys.exit(main())
