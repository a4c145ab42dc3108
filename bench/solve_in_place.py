"""A damped Gram solve factorised in place against the same solve on copies: extra memory, time, and the answer.

``linalg.ridge`` solves ``W = (Y Zᵀ)(H + δI)⁻¹`` for the ``n × n`` Gram matrix ``H`` it must keep. Factorised as
``torch.linalg.cholesky`` and ``torch.cholesky_solve`` do, the solve holds three more ``n × n`` buffers (the damped
copy, the factor, ``cholesky_solve``'s copy of it); ``linalg.solve_spd`` factorises the damped copy in its own
memory. Each variant runs in a fresh process (its peak resident set is its own), alternating, ``--repeats`` times:

    python bench/solve_in_place.py --n 4864,8192 --d 1024

Writes ``bench/results/solve_in_place.{csv,md}``: per ``n``, the peak resident set above the inputs (in ``n × n``
float32 buffers) and the median time of each variant, and whether the two answers are equal to the bit.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch


def inputs(n: int, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Gram matrix of ``2n`` random tokens with channel scales over four decades, ``Y Zᵀ`` and the damping; the
    tokens are drawn 256 at a time, so the process's peak before the solve is ``H`` and little more."""
    from spap_lib.numerics.linalg import add_gram

    g = torch.Generator().manual_seed(0)
    H, scale = torch.zeros(n, n), torch.logspace(-2, 2, n)
    for _ in range(0, 2 * n, 256):
        add_gram(H, torch.randn(256, n, generator=g) * scale)
    return H, torch.randn(d, n, generator=g), torch.full((n,), 1e-3 * float(H.diagonal().mean()))


def on_copies(WH: torch.Tensor, H: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """The solve as ``torch.linalg.cholesky`` and ``cholesky_solve`` do it (Jacobi-scaled, as ``solve_spd``)."""
    A = H.clone()
    A.diagonal().add_(penalty)
    s = A.diagonal().rsqrt()
    A.mul_(s[:, None]).mul_(s[None, :])
    return (torch.cholesky_solve(WH.T * s[:, None], torch.linalg.cholesky(A)) * s[:, None]).T


def one(variant: str, n: int, d: int, out: str | None) -> dict:
    from spap_lib.numerics.solve import ridge

    H, WH, penalty = inputs(n, d)
    solve = ridge if variant == "in place" else on_copies
    solve(WH[:, :64], H[:64, :64].contiguous(), penalty[:64])  # the libraries' one-off initialisation
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    W = solve(WH, H, penalty)
    seconds = time.perf_counter() - start
    extra = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024  # kB on Linux
    if out:
        torch.save(W, out)
    return {"seconds": seconds, "extra buffers": extra / (n * n * 4)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", default="4864,8192")
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="bench/results/solve_in_place")
    ap.add_argument("--one", nargs=3, metavar=("VARIANT", "N", "SAVE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        variant, n, save = args.one
        print(json.dumps(one(variant, int(n), args.d, save or None)))
        return
    import pandas as pd

    from spap_lib.artifact.figures import markdown_table
    from spap_lib.artifact.manifest import device_name, git_revision
    from spap_lib.files import write_csv_atomic, write_text_atomic

    command = " ".join(["python", "bench/solve_in_place.py", *(sys.argv[1:] if argv is None else argv)])
    rows, tmp = [], Path(args.out).parent
    for n in (int(x) for x in args.n.split(",")):
        runs = {"on copies": [], "in place": []}
        for r in range(args.repeats):
            for variant in runs:
                save = str(tmp / f".solve-{variant.replace(' ', '-')}.pt") if r == 0 else ""
                done = subprocess.run([sys.executable, __file__, "--d", str(args.d), "--one", variant, str(n), save],
                                      capture_output=True, text=True, check=True)
                runs[variant].append(json.loads(done.stdout.strip().splitlines()[-1]))
        answers = [torch.load(tmp / f".solve-{v.replace(' ', '-')}.pt") for v in runs]
        for v in runs:
            (tmp / f".solve-{v.replace(' ', '-')}.pt").unlink()
        row = {"n": n, "d": args.d, "tokens": 2 * n, "same answer (bitwise)": bool(torch.equal(*answers))}
        for v, rs in runs.items():
            row[f"{v}: extra n x n buffers"] = round(max(r["extra buffers"] for r in rs), 2)
            row[f"{v}: s"] = round(statistics.median(r["seconds"] for r in rs), 3)
        row["time in place / on copies"] = round(row["in place: s"] / row["on copies: s"], 3)
        row |= {"threads": torch.get_num_threads(), "command": command, "revision": git_revision()}
        rows.append(row)
        print(row, flush=True)
    table = pd.DataFrame(rows)
    write_csv_atomic(Path(args.out + ".csv"), table)
    write_text_atomic(Path(args.out + ".md"), (
        f"# A damped Gram solve in place against the same solve on copies ({device_name('cpu')}, float32)\n\n"
        "Peak resident set above the inputs, in n x n float32 buffers (the most of the repeats; each variant in a "
        "fresh process), and the median time of each variant, alternating in one run.\n\n"
        + markdown_table(table, index=False) + "\n"))


if __name__ == "__main__":
    main()
