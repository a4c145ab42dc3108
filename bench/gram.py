"""The Gram pass's product, whole against upper-triangle blocks (``linalg.add_gram`` + ``mirror``), side by side.

Every fitting method spends most of a layer on ``H = Σ Zᵀ Z`` over the calibration tokens. ``H`` is symmetric, so
``add_gram`` multiplies each of ``GRAM_BLOCKS`` blocks of rows only with the columns from its diagonal on. This
times one pass of ``tokens`` tokens in chunks of ``chunk`` both ways, interleaved (whole, then blocks, in each
repeat), at the widths of the offline models' layers, and reports the ratio and the largest difference from the
whole product.

    python bench/gram.py --widths 1536 4864 8192 --tokens 65536
"""
from __future__ import annotations

import argparse
import sys
import time

import pandas as pd
import torch

from spap_lib.artifact.figures import markdown_table
from spap_lib.artifact.manifest import device_name, git_revision
from spap_lib.files import write_csv_atomic, write_text_atomic
from spap_lib.numerics.linalg import GRAM_BLOCKS, add_gram, mirror


def whole(Z_chunks: list[torch.Tensor], n: int) -> torch.Tensor:
    H = torch.zeros(n, n, device=Z_chunks[0].device)
    for Z in Z_chunks:
        H += Z.T @ Z
    return H


def blocked(Z_chunks: list[torch.Tensor], n: int) -> torch.Tensor:
    H = torch.zeros(n, n, device=Z_chunks[0].device)
    for Z in Z_chunks:
        add_gram(H, Z)
    return mirror(H)


def seconds(fn, *a, device: torch.device) -> tuple[float, torch.Tensor]:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn(*a)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", type=int, nargs="+", default=[1536, 4864, 8192])
    ap.add_argument("--tokens", type=int, default=65536, help="tokens per pass")
    ap.add_argument("--chunk", type=int, default=8192, help="tokens per chunk (the pipeline's default)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default="bench/results/gram.csv")
    args = ap.parse_args(argv)
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    command = " ".join(["python", "bench/gram.py", *(sys.argv[1:] if argv is None else argv)])
    rows = []
    for n in args.widths:
        g = torch.Generator().manual_seed(n)
        # a chunk of tokens repeated: the product's cost, not the generator's
        Z = torch.randn(args.chunk, n, generator=g).to(device)
        chunks = [Z] * max(1, args.tokens // args.chunk)
        seconds(blocked, chunks[:1], n, device=device)  # warm-up both paths
        seconds(whole, chunks[:1], n, device=device)
        times = {"whole": [], "blocks": []}
        for _ in range(args.repeats):  # interleaved: drift hits both
            t, H_whole = seconds(whole, chunks, n, device=device)
            times["whole"].append(t)
            t, H_blocks = seconds(blocked, chunks, n, device=device)
            times["blocks"].append(t)
        diff = float((H_blocks - H_whole).abs().max() / H_whole.abs().max())
        rows.append({"device": device.type, "n": n, "tokens": len(chunks) * args.chunk,
                     "whole_s": min(times["whole"]), "blocks_s": min(times["blocks"]),
                     "speedup": min(times["whole"]) / min(times["blocks"]), "max_rel_diff": diff,
                     "symmetric": bool(torch.equal(H_blocks, H_blocks.T))})
        print(rows[-1], flush=True)
    frame = pd.DataFrame(rows)
    write_csv_atomic(args.out, frame)
    where = device_name(device)
    write_text_atomic(args.out.replace(".csv", ".md"), (
        f"# The Gram pass: whole product against upper-triangle blocks\n\nCommand: `{command}`  \n"
        f"Revision: `{git_revision()}`  \nMachine: {where}, float32, chunks of {args.chunk} tokens, "
        f"{GRAM_BLOCKS} blocks, best of {args.repeats} interleaved (whole, then blocks, in each repeat).\n\n"
        f"{markdown_table(frame, index=False, floatfmt='.3g')}\n\n"
        "`speedup`: the whole product's time over the blocks' (`add_gram` for every chunk, then `mirror`); "
        "`max_rel_diff`: the largest entry of the difference over the largest entry of `H`; `symmetric`: the "
        "blocks' `H` equals its transpose exactly.\n"))


if __name__ == "__main__":
    main()
