"""The plan's time per layer against every measured layer time (``bench/results/measured_layer_times.csv``).

Each measured row names its device (a row of ``spap_lib/throughput.json``), model, method, the hyperparameters
that decide its time (rows measured before an option existed name the setting they ran: ``sketch_tokens=0,
update_precision=full`` is the update before sketching), calibration tokens, offload, the revision and where
it was measured. ``scope`` says what was timed: ``prune`` the whole prune of a layer (its forward passes,
onloading and the method; ``Plan.prune_seconds`` per layer), ``method`` the method alone on captured inputs
(``bench/tune.py``: the method's own stages). The plan is computed for the model's shipped config; a layer's
time does not depend on how many layers the measured checkpoint kept.

    python bench/plan_times.py            # writes bench/results/plan_times.md
    python bench/plan_times.py --check    # exit 1 if a row is outside the tolerance
    python bench/plan_times.py --fit h100 # fit the GPU row's pipeline terms to its measured rows

``--fit`` finds the terms ``throughput.json`` keeps for a GPU (what its rates achieve in spap's own passes and
solves, the cost of a sequential step, the pageable host link) by least squares on the log ratio, each fraction at
most 1, and reports each row's ratio when that row is left out of the fit: the error to expect on a layer the fit
has not seen.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from contextlib import contextmanager

import pandas as pd

from spap_lib.artifact.figures import markdown_table
from spap_lib.artifact.manifest import git_revision
from spap_lib.files import write_text_atomic
from spap_lib.plan import THROUGHPUT, plan

MEASURED = "bench/results/measured_layer_times.csv"
OUT = "bench/results/plan_times.md"
TOLERANCE = 0.30  # predicted within ±30% of measured


def predicted(row) -> float:
    """The plan's seconds per layer for what the row timed."""
    p = plan(row.model, method=row.method, hparams=json.loads(row.hparams), nsamples=int(row.nsamples),
             seqlen=int(row.seqlen), eval_seqlen=int(row.seqlen), device=row.device, offload=row.offload)
    seconds = p.prune_seconds if row.scope == "prune" else sum(p.seconds[k] for k in p.method_stages)
    return seconds / p.layers


@contextmanager
def terms(device: str, products: float, solves: float, step: float, link: float):
    """``device``'s row of throughput.json with these pipeline terms, for the duration of the block."""
    row = THROUGHPUT[device]
    saved = copy.deepcopy(row)
    row.update(achieved={"matmul_tf32": products, "matmul_bf16": products, "cholesky_fp32": solves,
                         "cholesky_fp64": solves}, step_seconds=step, pageable_copy_gb_s=link)
    try:
        yield
    finally:
        row.clear()
        row.update(saved)


def fit(frame: pd.DataFrame, device: str) -> tuple[dict, list[float]]:
    """The terms and each row's left-out ratio. A layer's predicted time is linear in 1/fraction, the step cost
    and 1/link, so five plans per row give its coefficients and the fit runs on them."""
    import numpy as np
    from scipy.optimize import minimize

    rows = list(frame[frame.device == device].itertuples())
    measured = np.array([r.measured_s_per_layer for r in rows])

    def at(*x):
        with terms(device, *x):
            return np.array([predicted(r) for r in rows])

    base = at(1.0, 1.0, 0.0, 1e12)
    coef = [at(0.5, 1.0, 0.0, 1e12) - base, at(1.0, 0.5, 0.0, 1e12) - base, at(1.0, 1.0, 1.0, 1e12) - base,
            at(1.0, 1.0, 0.0, 1.0) - base]  # at 1/fraction = 2 the extra time is one coefficient
    names = ["products", "solves", "step", "link"]

    def model(x):
        products, solves, step, link = np.exp(x)
        return base + coef[0] * (1 / products - 1) + coef[1] * (1 / solves - 1) + coef[2] * step + coef[3] / link

    def solve(keep):
        loss = lambda x: float((np.log(model(x)[keep] / measured[keep]) ** 2).sum())  # noqa: E731
        return minimize(loss, np.log([0.5, 0.5, 1e-3, 2.0]), method="L-BFGS-B",
                        bounds=[(-5, 0), (-5, 0), (-12, 0), (-3, 4)]).x

    every = np.ones(len(rows), bool)
    best = dict(zip(names, np.exp(solve(every)).round(4).tolist()))
    left_out = [float(model(solve(every & (np.arange(len(rows)) != i)))[i] / measured[i]) for i in range(len(rows))]
    return best, left_out


def table() -> pd.DataFrame:
    frame = pd.read_csv(MEASURED, keep_default_na=False)
    frame["predicted_s_per_layer"] = [round(predicted(r), 3) for r in frame.itertuples()]
    frame["predicted / measured"] = (frame.predicted_s_per_layer / frame.measured_s_per_layer).round(2)
    return frame


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help=f"exit 1 if a row is outside ±{TOLERANCE:.0%}")
    ap.add_argument("--fit", metavar="DEVICE", help="fit DEVICE's pipeline terms to its measured rows")
    args = ap.parse_args(argv)
    # The CPU rows, and the cpu-2core rates, were measured on CPUs with bf16 units: priced with those kernels on any
    # machine (the plan reads the machine's own otherwise, ``bf16.rounded``)
    os.environ["SPAP_BF16_PRODUCTS"] = "native"
    if args.fit:
        best, left_out = fit(pd.read_csv(MEASURED, keep_default_na=False), args.fit)
        print(f"{args.fit}: {best}; each row left out of the fit: predicted / measured "
              + ", ".join(f"{r:.2f}" for r in left_out))
        return
    frame = table()
    off = frame[(frame["predicted / measured"] - 1).abs() > TOLERANCE]
    if args.check:
        print(frame[["device", "model", "method", "hparams", "offload", "scope", "measured_s_per_layer",
                     "predicted_s_per_layer", "predicted / measured"]].to_string(index=False))
        if len(off):
            sys.exit(f"{len(off)} rows outside ±{TOLERANCE:.0%} of the plan")
        return
    notes = []
    frame["left out of the fit"] = ""
    for device in sorted({d for d in frame.device if THROUGHPUT[d].get("fitted")}):
        best, left_out = fit(frame, device)
        frame.loc[frame.device == device, "left out of the fit"] = [f"{r:.2f}" for r in left_out]
        notes.append(f"* {device}: {THROUGHPUT[device]['fitted']} (throughput.json). Refitted on these rows: "
                     f"{best}. 'left out of the fit': predicted / measured when the row's own time is not in the "
                     "fit.")
    cols = ["device", "model", "method", "hparams", "nsamples", "seqlen", "offload", "scope", "measured_s_per_layer",
            "predicted_s_per_layer", "predicted / measured", "left out of the fit", "revision", "source"]
    write_text_atomic(OUT, (
        "# The plan's time per layer against measured layers\n\n"
        f"Command: `python bench/plan_times.py` (git {git_revision()}); the measured rows: "
        "[measured_layer_times.csv](measured_layer_times.csv), each with the revision it ran at and its source. "
        f"Rows outside ±{TOLERANCE:.0%}: {len(off)}.\n\n" + "\n".join(notes) + "\n\n"
        + markdown_table(frame[cols], index=False) + "\n"))
    print(frame[cols[:11]].to_string(index=False))


if __name__ == "__main__":
    main()
