"""SPAP's Adam steps as the update runs them (``adam_steps_on``, one launch per kernel) against the same step
captured once as a CUDA graph and replayed, side by side on one GPU, on random layers of a model's shapes.

On small layers the GPU is idle most of a SPAP prune: the host launches a few dozen kernels per Adam step and
each one runs for microseconds (bench/results/profile_layer_smollm2_h200.md). A graph replays a whole step with
one launch. This measures what that would save before the library carries it, and how far the graphed weights
drift from the eager ones (the capturable Adam computes its bias correction on the device).

    python bench/adam_graph.py --model smollm2-135m qwen2.5-coder-0.5b --out bench/results/adam_graph_h200.csv
"""
from __future__ import annotations

import argparse
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import pandas as pd
import torch

from spap_lib.artifact.figures import markdown_table
from spap_lib.artifact.manifest import device_name, git_revision
from spap_lib.files import write_csv_atomic, write_text_atomic
from spap_lib.methods.spap.alternating import adam, adam_steps_on, trainable
from spap_lib.model.adapters import MLP
from spap_lib.plan import shipped_config


def random_mlp(d: int, n: int, device: torch.device, seed: int) -> MLP:
    gen = torch.Generator().manual_seed(seed)
    W = [torch.randn(n, d, generator=gen) / d ** 0.5 for _ in range(2)] + [torch.randn(d, n, generator=gen) / n ** 0.5]
    return MLP([W[0].to(device), W[1].to(device)], [None, None], W[2].to(device), None, torch.nn.functional.silu,
               True)


def loss_of(mlp: MLP, x: torch.Tensor, y: torch.Tensor, low: bool) -> torch.Tensor:
    # the autocast weight cache must stay off under capture: a cached cast would be captured once and never redone
    cast = torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False) if low else nullcontext()
    with cast:
        return torch.nn.functional.mse_loss(mlp(x.float()).float(), y.float())


def graphed_rounds(mlp: MLP, X: torch.Tensor, Y: torch.Tensor, rounds: int, steps: int, batch: int, lr: float,
                   low: bool, seed: int) -> None:
    """``rounds × steps`` Adam steps with the draws of ``adam_steps_on``; one step captured, then replayed."""
    params = [*mlp.W_in]
    with trainable(params):
        _graphed(mlp, params, X, Y, rounds, steps, batch, lr, low, seed)


def _graphed(mlp: MLP, params: list[torch.Tensor], X: torch.Tensor, Y: torch.Tensor, rounds: int, steps: int,
             batch: int, lr: float, low: bool, seed: int) -> None:
    opt = torch.optim.Adam([{"params": [p], "lr": lr * float(p.detach().pow(2).mean().sqrt())} for p in params],
                           lr=lr, fused=True, capturable=True)
    # Adam's state must exist before the capture; a step on zero gradients creates it and moves no weight
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    for state in opt.state.values():
        state["step"].zero_()
    idx = torch.zeros(min(batch, X.shape[0]), dtype=torch.long, device=X.device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (cuBLAS workspaces): forward and backward only, no weight moves
        for _ in range(3):
            loss_of(mlp, X.index_select(0, idx), Y.index_select(0, idx), low).backward()
    torch.cuda.current_stream().wait_stream(side)
    opt.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss_of(mlp, X.index_select(0, idx), Y.index_select(0, idx), low).backward()
        opt.step()
    gen = torch.Generator().manual_seed(seed)
    for _ in range(rounds):
        draws = torch.randint(X.shape[0], (steps, idx.shape[0]), generator=gen).to(X.device)
        for row in draws:
            idx.copy_(row)
            graph.replay()


def eager_rounds(mlp: MLP, X: torch.Tensor, Y: torch.Tensor, rounds: int, steps: int, batch: int, lr: float,
                 low: bool, seed: int) -> None:
    params, opt = adam(mlp.W_in, mlp.b_in, lr, "rms")
    gen = torch.Generator().manual_seed(seed)
    with trainable(params):
        for _ in range(rounds):
            adam_steps_on(mlp, X, Y, opt, gen, steps, batch, low)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b"])
    ap.add_argument("--tokens", type=int, default=128 * 512)
    ap.add_argument("--sparsity", type=float, default=0.2)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=5e-3)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    device = torch.device("cuda")
    rows = []
    for model in a.model:
        config = shipped_config(model)
        d, n_dense = config.hidden_size, config.intermediate_size
        n = n_dense - round(a.sparsity * n_dense)
        gen = torch.Generator().manual_seed(0)
        X = torch.randn(a.tokens, d, generator=gen).to(device, torch.bfloat16)
        Y = (torch.randn(a.tokens, d, generator=gen) * 0.1).to(device, torch.bfloat16)
        for rep in range(a.repeat + 1):  # the first repetition warms both up and is not kept
            result = {}
            for name, run in (("eager", eager_rounds), ("graph", graphed_rounds)):
                mlp = random_mlp(d, n, device, seed=1)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                run(mlp, X, Y, a.rounds, a.steps, a.batch, a.lr, True, 0)
                torch.cuda.synchronize()
                result[name] = (time.perf_counter() - t0, mlp)
            if rep:
                drift = max(float((g - e).abs().max() / e.abs().max())
                            for g, e in zip(result["graph"][1].W_in, result["eager"][1].W_in))
                rows.append({"model": model, "d": d, "n": n, "tokens": a.tokens, "steps": a.rounds * a.steps,
                             "batch": a.batch, "eager_s": result["eager"][0], "graph_s": result["graph"][0],
                             "speedup": result["eager"][0] / result["graph"][0], "max_rel_weight_diff": drift})
                print(rows[-1], flush=True)
    df = pd.DataFrame(rows)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    write_csv_atomic(a.out, df)
    summary = df.groupby("model", sort=False)[["eager_s", "graph_s", "speedup", "max_rel_weight_diff"]].median()
    write_text_atomic(a.out.with_suffix(".md"),
                 f"# Adam steps: eager against one CUDA graph per step\n\nCommand: `python bench/adam_graph.py "
                 f"{' '.join(sys.argv[1:])}`  \nRevision: `{git_revision()}`  \nDevice: {device_name(device)}; random "
                 f"weights, {a.tokens} random tokens, bf16 products, {a.rounds * a.steps} steps of {a.batch} tokens; "
                 f"median of {a.repeat} runs after a warm-up.\n\n{markdown_table(summary, floatfmt='.4g')}\n")


if __name__ == "__main__":
    main()
