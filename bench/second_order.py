"""Would a second-order step on the gate/up projections make SPAP's rounds cheaper? Held-out error and seconds per
layer, side by side with the default rounds (Adam).

The candidate replaces each round's Adam steps (``alternating.adam_steps_on``) with Gauss-Newton steps whose
curvature is Kronecker-factored (K-FAC): for a GLU MLP ``y = D (act(G x) ⊙ U x)`` with ``D`` fixed, the curvature of
``U`` is approximated by ``(DᵀD ∘ E[c cᵀ]) ⊗ E[x xᵀ]`` with ``c = act(G x)`` (for ``G``: ``c = U x ⊙ act'(G x)``),
each factor damped by ``gamma`` times its mean diagonal, and the step length is the exact minimiser of the
Gauss-Newton model along the preconditioned direction. Each step reads a fresh sample of ``--kfac-sample`` tokens.
Everything else (the penalty stage, the closed forms on fresh samples, the ranking, the final refit) is the default
method's, so the two columns differ only in how the input projections move.

    python bench/second_order.py --nsamples 128 --steps 1 2 --out bench/results/second_order_smollm2_128x512.csv
"""
from __future__ import annotations

import sys
import time
from contextlib import nullcontext
from unittest import mock

import pandas as pd
import torch
from common import layer_bench_parser, mlp_inputs  # bench/, the script's own folder

import spap_lib as sl
import spap_lib.methods.spap.alternating as alternating
from spap_lib.artifact.figures import markdown_table
from spap_lib.artifact.manifest import device_name, git_revision
from spap_lib.files import write_csv_atomic, write_text_atomic
from spap_lib.methods import LayerProblem
from spap_lib.model.adapters import MLP


def silu_slope(h: torch.Tensor, sig: torch.Tensor) -> torch.Tensor:
    return sig * (1 + h * (1 - sig))


@torch.no_grad()
def kfac_step(mlp: MLP, X: torch.Tensor, Y: torch.Tensor, B_inv: torch.Tensor, gamma: float, bf16: bool) -> None:
    """One damped Gauss-Newton step on ``‖Y − mlp(X)‖²`` over the gate and up projections (SiLU GLU, no biases)."""
    G, U = mlp.W_in
    D, n = mlp.W_out, X.shape[0]
    dt = torch.bfloat16 if bf16 else torch.float32
    Xc = X.to(dt)
    h, a = (Xc @ G.to(dt).T).float(), (Xc @ U.to(dt).T).float()
    sig = torch.sigmoid(h)
    s = h * sig
    e = (s * a @ D.T - Y) @ D  # the residual pulled back to the channels
    DtD = D.T @ D
    directions, grads, slopes = [], [], []
    for c in (s, a * silu_slope(h, sig)):  # U's, then G's
        g = ((e * c).to(dt).T @ Xc).float()
        A = DtD * (c.to(dt).T @ c.to(dt)).float() / n
        A.diagonal().add_(gamma * A.diagonal().mean())
        directions.append(torch.cholesky_solve(g, torch.linalg.cholesky(A)) @ B_inv / n)
        grads.append(g)
        slopes.append(c)
    dU, dG = directions
    moved = ((Xc @ dU.to(dt).T).float() * slopes[0] + (Xc @ dG.to(dt).T).float() * slopes[1]) @ D.T
    alpha = float((grads[0] * dU).sum() + (grads[1] * dG).sum()) / max(float(moved.pow(2).sum()), 1e-30)
    U.sub_(alpha * dU)
    G.sub_(alpha * dG)


def kfac_rounds(steps: int, sample: int, gamma: float):
    """A stand-in for ``adam_steps_on``: ``steps`` K-FAC steps, each on a fresh sample of ``sample`` tokens."""
    inverse: dict[int, torch.Tensor] = {}

    def steps_on(mlp, X, Y, opt, gen, _steps, _batch_tokens, in_bf16=False):
        if id(X) not in inverse:  # E[x xᵀ] once per layer: the inputs do not change
            B = X.T @ X / X.shape[0]
            B.diagonal().add_(gamma * B.diagonal().mean())
            inverse.clear()
            inverse[id(X)] = torch.cholesky_inverse(torch.linalg.cholesky(B))
        for _ in range(steps):
            idx = torch.randint(X.shape[0], (sample,), generator=gen)
            kfac_step(mlp, X[idx], Y[idx], inverse[id(X)], gamma, in_bf16)
    return steps_on


def main(argv=None) -> None:
    ap = layer_bench_parser(__doc__)
    ap.add_argument("--held", type=int, default=32, help="held-out windows (seed 1)")
    ap.add_argument("--steps", type=int, nargs="+", default=[1, 2], help="K-FAC steps per round")
    ap.add_argument("--kfac-sample", type=int, default=4096, help="tokens of each K-FAC step")
    ap.add_argument("--gamma", type=float, default=0.01, help="damping, relative to each factor's mean diagonal")
    ap.add_argument("--out", default="bench/results/second_order.csv")
    args = ap.parse_args(argv)
    layers = [int(x) for x in args.layers.split(",")]
    loaded = sl.load(args.model, device="cpu")
    first = loaded.adapter.get_mlp(loaded.adapter.layers()[0])
    silu = type(first.act).__name__ in ("SiLU", "SiLUActivation")
    if not (first.glu and silu and all(b is None for b in first.b_in)):
        raise SystemExit(f"the K-FAC step here is written for SiLU GLU MLPs without biases (SmolLM2, Qwen2.5); "
                         f"{args.model}'s MLP is not one")
    fit = sl.calibration_windows(loaded.tokenizer, args.nsamples, args.seqlen, seed=0)
    held = sl.calibration_windows(loaded.tokenizer, args.held, args.seqlen, seed=1)
    X_fit, X_held = mlp_inputs(loaded, fit.windows, layers), mlp_inputs(loaded, held.windows, layers)
    plan = sl.plan_sparsity(loaded.adapter, args.sparsity)
    settings = {"fasp": None, "spap (Adam rounds)": None,
                **{f"spap, {k} K-FAC step(s) of {args.kfac_sample} tokens per round":
                   kfac_rounds(k, args.kfac_sample, args.gamma) for k in args.steps}}
    rows = []
    for i in layers:
        dense = loaded.adapter.get_mlp(loaded.adapter.layers()[i])
        Y_held = dense(X_held[i])
        for label, steps_on in settings.items():
            method = sl.get_method("fasp" if label == "fasp" else "spap")
            patch = mock.patch.object(alternating, "adam_steps_on", steps_on) if steps_on else nullcontext()
            with patch:
                t0 = time.perf_counter()
                res = method.prune(LayerProblem.of(method, dense, X_fit[i], plan.n_remove, seed=0, layer_index=i))
                seconds = time.perf_counter() - t0
            err = float((res.mlp(X_held[i]) - Y_held).pow(2).sum() / Y_held.pow(2).sum())
            rows.append({"layer": i, "setting": label, "heldout_rel_error": err, "seconds": seconds})
            print(rows[-1], flush=True)
            write_csv_atomic(args.out, pd.DataFrame(rows))
    frame = pd.DataFrame(rows)
    summary = frame.groupby("setting", sort=False)[["heldout_rel_error", "seconds"]].mean()
    summary["seconds / fasp"] = summary["seconds"] / summary.loc["fasp", "seconds"]
    command = " ".join(["python", "bench/second_order.py", *(sys.argv[1:] if argv is None else argv)])
    write_text_atomic(args.out.replace(".csv", ".md"), (
        f"# A second-order step in SPAP's rounds\n\nCommand: `{command}`  \ngit: {git_revision()}  \n"
        f"Device: {device_name(torch.device('cpu'))}; {args.model} layers {layers}, sparsity {args.sparsity}; "
        f"fit {fit.describe()}; held-out {held.describe()}; damping {args.gamma}.\n"
        f"Mean over layers of the held-out relative error and seconds per layer (one run, settings interleaved "
        f"layer by layer):\n\n{markdown_table(summary)}\n"))
    print(summary.to_string())


if __name__ == "__main__":
    main()
