"""Where a layer's least-squares objective puts its weight: the share of each MLP's dense output energy ``‖Y‖²``
that its largest tokens and each window's first position hold.

Every layer-wise fit here (the penalty method, the least-squares refit, the update's closed forms) minimises
``‖Y − W Z‖²`` summed over the calibration tokens, so a token holding most of ``‖Y‖²`` decides the fit. Dense model,
calibration windows as in the grid (seed 0), inputs propagated through the dense layers.

    python bench/output_energy.py --model qwen2.5-coder-0.5b --nsamples 8 --seqlen 512
"""
from __future__ import annotations

import argparse
import sys

import pandas as pd
import torch

import spap_lib as sl
from spap_lib.artifact.figures import markdown_table
from spap_lib.artifact.manifest import git_revision
from spap_lib.files import write_csv_atomic, write_text_atomic
from spap_lib.model.capture import first_layer_inputs, replay
from spap_lib.numerics.linalg import chunk_for, token_energies, top_share


@torch.no_grad()
def energy_shares(model: str, nsamples: int, seqlen: int) -> pd.DataFrame:
    loaded = sl.load(model, device="cpu")
    calib = sl.calibration_windows(loaded.tokenizer, nsamples, seqlen, 0)
    layers = loaded.adapter.layers()
    hidden, kwargs = first_layer_inputs(loaded.model, layers, calib.windows, 1, loaded.device)
    rows = []
    for i, layer in enumerate(layers):
        hidden, X = replay(layer, hidden, {b: kw[i] for b, kw in kwargs.items()}, 1,
                           watch=loaded.adapter.mlp_input_module(layer))
        mlp = loaded.adapter.get_mlp(layer)
        e = token_energies(X, chunk_for(mlp.width, 8192), mlp.W_out.device, mlp=mlp)  # ‖y_t‖², window by window
        rows.append({"layer": i, "largest token": top_share(e, 0.0), "largest 1% of tokens": top_share(e, 0.01),
                     "first position of each window": float(e.view(nsamples, seqlen)[:, 0].sum() / e.sum())})
    return pd.DataFrame(rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--nsamples", type=int, default=8)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--out", default=None, help="default bench/results/output_energy_<model>.csv")
    args = ap.parse_args(argv)
    out = args.out or f"bench/results/output_energy_{args.model}.csv"
    frame = energy_shares(args.model, args.nsamples, args.seqlen)
    write_csv_atomic(out, frame)
    command = " ".join(["python", "bench/output_energy.py", *(sys.argv[1:] if argv is None else argv)])
    write_text_atomic(out.replace(".csv", ".md"), (
        f"# Share of each MLP's dense output energy ‖Y‖²\n\nCommand: `{command}`  \nRevision: `{git_revision()}`  \n"
        f"{args.model}, {args.nsamples} x {args.seqlen} calibration tokens (seed 0), the dense model.\n\n"
        f"{markdown_table(frame.round(3), index=False)}\n"))


if __name__ == "__main__":
    main()
