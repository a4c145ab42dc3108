"""The update's rounds (SPAP §3.3) and the gradient-descent ablation, with what they share: Adam with a rate per
tensor, token samples, and keeping the best round.

``alternating_update`` alternates Adam on the input projections (gate/up, or fc1) with the closed-form output
projection ``W = Y Z̃ᵀ(Z̃ Z̃ᵀ + δI)⁻¹``; ``gradient_update`` runs Adam on every projection (the paper's
"SPAP w. GD"). Both keep the round of lowest calibration error, never worse than where they started
(``best_round``). The cheap rounds (a token sample, bf16 products, one refit on every token) are
deviations from the paper, listed in ``spap``.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Callable

import torch

from spap_lib.checks import hp
from spap_lib.methods.base import LayerProblem
from spap_lib.methods.parts.selection import UPDATES, Update
from spap_lib.model.adapters import MLP
from spap_lib.numerics.collective import all_sum, grads_sum_, local_rows, span, subsample, total, world
from spap_lib.numerics.linalg import energies, gram, mean_diag, products, rows, sq_norm
from spap_lib.numerics.solve import reconstruction_error, ridge


@contextmanager
def trainable(params: list[torch.Tensor]):
    """Gradients for ``params`` inside the block only (the pipeline runs everything else without)."""
    for p in params:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p in params:
            p.requires_grad_(False)


def _rms(t: torch.Tensor) -> float:
    return float(t.detach().double().pow(2).mean().sqrt())


def adam(weights: list[torch.Tensor], biases: list[torch.Tensor | None], lr: float,
         lr_scale: str) -> tuple[list[torch.Tensor], torch.optim.Adam]:
    """Adam over ``weights`` and the ``biases`` that exist (``biases[i]`` is added after ``weights[i]``), in
    that order; returns the parameters and the optimiser. With ``lr_scale="rms"`` each tensor's rate is
    ``lr × RMS(tensor)``; an all-zero bias takes its weight's RMS (and a tensor with nothing to scale by, ``lr``).
    The fused step (one kernel per tensor) where the device has one: the same update in less time than the
    per-operation step (docs/method/update-cost.md: the savings that leave the answer as it was)."""
    pairs = [*((W, W) for W in weights), *((b, W) for W, b in zip(weights, biases) if b is not None)]
    params = [p for p, _ in pairs]
    fused = all(p.device.type in ("cpu", "cuda") for p in params) or None
    if lr_scale == "absolute":
        return params, torch.optim.Adam(params, lr=lr, fused=fused)
    return params, torch.optim.Adam([{"params": [p], "lr": lr * (_rms(p) or _rms(W) or 1.0)} for p, W in pairs], lr=lr,
                                    fused=fused)


def adam_steps_on(mlp: MLP, X: torch.Tensor, Y: torch.Tensor, opt: torch.optim.Optimizer, gen: torch.Generator,
                  steps: int, batch_tokens: int, in_bf16: bool = False) -> None:
    """``steps`` Adam steps on ``‖Y − mlp(X)‖²`` over random mini-batches of ``batch_tokens`` tokens
    (forward and backward products in bf16 with ``in_bf16``; the weights and Adam's state stay float32). Across ranks
    (``collective``) the mini-batches are drawn over the global rows, each rank adds the loss of the rows it holds,
    and the gradients are summed before each step: the steps one process would take."""
    device = mlp.W_out.device  # X and Y may wait in host memory: each mini-batch is gathered there and moved
    start, N = span(X.shape[0])
    parallel = world().parallel
    # Every step's mini-batch drawn at once (the same draws as one call per step) and moved in one copy: on a GPU
    # a copy per step made the host wait for the device at every step (docs/scale.md: SPAP against FASP on an H100)
    batches = torch.randint(N, (steps, min(batch_tokens, N)), generator=gen)
    batches = [local_rows(b, start, X.shape[0]).to(X.device) for b in batches] if parallel else batches.to(X.device)
    params = [p for group in opt.param_groups for p in group["params"]]
    for idx in batches:
        x, y = (T.index_select(0, idx).to(device, non_blocking=True) for T in (X, Y))  # faster than ``T[idx]``
        with products(in_bf16, device):
            if parallel:  # this rank's share of the mini-batch's mean: the ranks' shares sum to it
                loss = torch.nn.functional.mse_loss(mlp(x.float()).float(), y.float(), reduction="sum") / \
                    (min(batch_tokens, N) * Y.shape[1])
            else:
                loss = torch.nn.functional.mse_loss(mlp(x.float()).float(), y.float())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grads_sum_(params)
        opt.step()


def rounds_sample(X: torch.Tensor, Y: torch.Tensor, YY: float, tokens: int, seed: int, chunk: int,
                  device) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The update rounds' data: ``subsample`` of ``tokens`` tokens and its ``‖Y‖²`` (``YY`` when it is every token)."""
    Xr, Yr = subsample(X, Y, tokens, seed)
    return Xr, Yr, YY if Xr is X else max(sq_norm(Yr, chunk, device), torch.finfo(torch.float64).tiny)


def best_round(mlp: MLP, iters: int, step: Callable[[MLP], float], *, start_error: float, exact: bool,
               full_error: Callable[[MLP], float]) -> tuple[MLP, dict]:
    """Run ``step`` (one round in place on ``mlp``, returning its relative error on the rounds' data)
    ``iters`` times and keep the round of lowest error. When the rounds were not ``exact`` (a token
    sample or bf16 products), ``full_error`` then measures that round on every token at the method's
    precision (refitting what the rounds fitted), and the start wins if it is no worse: the update never
    makes a layer worse on its calibration data. The start and the best round wait in host memory: on a GPU
    the device holds the MLP being trained and its optimiser state, not three copies of it."""
    device = mlp.W_out.device
    start = mlp.clone("cpu")
    best_error, best = (start_error, start) if exact else (float("inf"), start)
    rounds = []
    for _ in range(iters):
        rounds.append(step(mlp))
        if rounds[-1] < best_error:
            best_error, best = rounds[-1], mlp.clone("cpu")
    improved, best = best is not start, best.to(device)
    final = full_error(best) if improved and not exact else best_error  # full_error refits ``best`` in place
    if final >= start_error:
        best, final = start.to(device), start_error
    return best, {"start": start_error, "rounds": rounds, "final": final}


@dataclass(frozen=True)
class Rounds:
    """How §3.3's rounds run: the schedule, Adam's settings and the cheap rounds' token sample and precision
    (docs/method/update-cost.md: Cost of the update). One object from the method's fields (``SPAP.rounds``)."""

    iters: int  # rounds (the paper's AM iterations)
    adam_steps: int  # Adam steps on the input projections per round
    lr: float
    batch_tokens: int  # tokens per Adam step
    damp: float  # the closed form's ridge, relative to mean(diag(Z Zᵀ))
    chunk: int  # tokens per Gram/forward chunk
    seed: int
    lr_scale: str = "rms"
    sketch_tokens: int = 0  # tokens of each round's closed form and error (0: all)
    bf16: bool = False  # the rounds' products in bf16 (``linalg.products``)
    resample: bool = False  # a fresh sample per round's closed form
    rank_tokens: int = 0  # tokens ranking resampled rounds (0: the sketch)
    refit_bf16: bool = False  # the final refit's products in bf16 too


def alternating_update(mlp: MLP, X: torch.Tensor, Y: torch.Tensor, rounds: Rounds, *, start_error: float, YY: float,
                       dtype: torch.dtype) -> tuple[MLP, dict]:
    """§3.3: alternate Adam on the input projections and the closed-form output projection.

    ``start_error`` is the starting point's relative error (known from the penalty stage's statistics, which
    the caller may then free) and ``YY`` the ``‖Y‖²`` it is relative to (``LayerProblem.YY``); ``dtype`` is the
    method's precision, of every Gram sum and solve. Cheap rounds (deviations): each round's closed form and error
    use ``sketch_tokens`` tokens (``subsample``; 0: all), and with ``bf16`` the rounds' products are bf16; the best
    round's output projection is then refitted once on every token at the method's precision (``best_round``). With
    ``resample`` each round's closed form draws a fresh sample (the rounds together see many more tokens,
    so the output projection does not overfit one sample), and the rounds are ranked by the error of a
    forward pass on the first sample, or on ``rank_tokens`` of its tokens (0: all of them). With ``refit_bf16`` that
    final refit's products are bf16 too (``linalg.gram``'s ``in_bf16``: ``Z Zᵀ`` stays a float32 product of the rounded
    ``Z``, summed at the method's precision). Returns the MLP and
    the relative calibration errors of the start, of every round (on the rounds' data) and of the result.
    """
    n, device = mlp.width, mlp.W_out.device
    r = rounds
    iters, adam_steps, batch_tokens, damp, chunk, seed = r.iters, r.adam_steps, r.batch_tokens, r.damp, r.chunk, r.seed
    sketch_tokens, in_bf16, resample, rank_tokens = r.sketch_tokens, r.bf16, r.resample, r.rank_tokens
    sampled = 0 < sketch_tokens < total(X.shape[0])
    resampled = resample and sampled
    # the rounds' one sample, or (resampled) the sample that ranks them
    Xr, Yr, YYr = rounds_sample(X, Y, YY, (rank_tokens or sketch_tokens) if resampled else sketch_tokens, seed,
                                chunk, device)
    # gate/up (fc1) weights and biases; one optimiser for all rounds: its moments carry over
    W_in, opt = adam(mlp.W_in, mlp.b_in, r.lr, r.lr_scale)
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def closed_form(m: MLP, X: torch.Tensor, Y: torch.Tensor, YY: float | None, in_bf16: bool) -> float:
        """(2) the output projection on the new Z̃: W = Y Z̃ᵀ (Z̃ Z̃ᵀ + δI)⁻¹; its error relative to ``YY`` (NaN
        when ``YY`` is None: not needed)."""
        with torch.no_grad():
            H, YZ = gram(m, X, chunk, Y, dtype=dtype, in_bf16=in_bf16)
            W = ridge(YZ, H, damping(H, n, damp))
            m.set_out_augmented(W)
            return float("nan") if YY is None else reconstruction_error(W, H, YZ, YY) / YY

    draws = iter(range(1, iters + 1))

    def one_round(m: MLP) -> float:
        # (1) the input projections: Adam on ‖Y − W σ(W_in X)‖² with the output projection W fixed
        adam_steps_on(m, X, Y, opt, gen, adam_steps, batch_tokens, in_bf16)
        if not resampled:
            return closed_form(m, Xr, Yr, YYr, in_bf16)
        Xs, Ys = subsample(X, Y, sketch_tokens, seed + next(draws))
        closed_form(m, Xs, Ys, None, in_bf16)
        with products(in_bf16, device):
            return calibration_error(m, Xr, Yr, chunk) / YYr

    def final_refit(m: MLP) -> float:
        # Adam's moments and the last gradients are done with: freed, the refit's Gram pass and solve have their
        # room: the refit was the prune's device peak while they lived (docs/scale.md: Streaming X and Y on a GPU,
        # measured)
        opt.state.clear()
        for p in W_in:
            p.grad = None
        return closed_form(m, X, Y, YY, r.refit_bf16)

    with trainable(W_in):
        return best_round(mlp, iters, one_round, start_error=start_error, exact=not sampled and not in_bf16,
                          full_error=final_refit)


def damping(H: torch.Tensor, n: int, damp: float) -> torch.Tensor:
    """``δ`` on every diagonal entry, ``δ = damp · mean(diag(Z Zᵀ))`` (the bias row excluded): the units of
    the penalty stage."""
    return torch.full((H.shape[0],), damp * mean_diag(H[:n, :n]), dtype=H.dtype, device=H.device)


@torch.no_grad()
def calibration_error(mlp: MLP, X: torch.Tensor, Y: torch.Tensor, chunk: int) -> float:
    """``‖Y − mlp(X)‖²`` a chunk of tokens at a time on the MLP's device, over every rank's tokens."""
    device = mlp.W_out.device
    local = sum(float(energies(mlp(rows(X, s, s + chunk, device).float()) - rows(Y, s, s + chunk, device).float())
                      .sum()) for s in range(0, X.shape[0], chunk))
    return all_sum(local)


def gradient_update(mlp: MLP, X: torch.Tensor, Y: torch.Tensor, rounds: Rounds, *, YY: float) -> tuple[MLP, dict]:
    """Adam on every projection of the MLP (inputs and output) for ``iters × adam_steps`` steps, checking
    the calibration error every ``adam_steps`` steps (on the same token sample and in the same precision as
    ``alternating_update``'s rounds; errors relative to ``YY = ‖Y‖²``) and returning the best iterate
    (``best_round``)."""
    device, r = mlp.W_out.device, rounds
    Xr, Yr, YYr = rounds_sample(X, Y, YY, r.sketch_tokens, r.seed, r.chunk, device)
    params, opt = adam([*mlp.W_in, mlp.W_out], [*mlp.b_in, mlp.b_out], r.lr, r.lr_scale)
    gen = torch.Generator(device="cpu").manual_seed(r.seed)

    def one_round(m: MLP) -> float:
        adam_steps_on(m, X, Y, opt, gen, r.adam_steps, r.batch_tokens, r.bf16)
        with products(r.bf16, device):
            return calibration_error(m, Xr, Yr, r.chunk) / YYr

    with trainable(params):
        return best_round(mlp, r.iters, one_round, start_error=calibration_error(mlp, X, Y, r.chunk) / YY,
                          exact=Xr is X and not r.bf16, full_error=lambda m: calibration_error(m, X, Y, r.chunk) / YY)


def _alternating_rounds(mlp: MLP, problem, rounds: Rounds, start_error: Callable[[], float]) -> tuple[MLP, dict]:
    start = start_error()
    problem.release_gram()  # the rounds accumulate their own
    return alternating_update(mlp, problem.X, problem.Y, rounds, start_error=start, YY=problem.YY, dtype=problem.dtype)


def _gradient_rounds(mlp: MLP, problem, rounds: Rounds, start_error: Callable[[], float]) -> tuple[MLP, dict]:
    problem.release_gram()  # its rounds measure their own start on the tokens
    return gradient_update(mlp, problem.X, problem.Y, rounds, YY=problem.YY)




@dataclass
class RoundSettings:
    """§3.3's round settings (``alternating.Rounds``): what a composition whose update runs rounds carries."""

    am_iters: int = hp(10, ge=0)  # alternating-minimisation rounds (paper: 20; why 10: docs/parameters.md)
    adam_steps: int = hp(10, ge=1)  # Adam steps on the input projections per round
    # Adam step in units of each tensor's RMS: best on Qwen2.5-Coder-0.5B at 128 x 512 and on SmolLM2 at 32 x 512;
    # SmolLM2 at 128 x 512 prefers 1e-2, which configs/offline.yaml sets (docs/parameters.md: lr)
    lr: float = hp(5e-3, gt=0)
    lr_scale: str = hp("rms", choices=("rms", "absolute"))  # "absolute": lr is the plain Adam rate
    batch_tokens: int = hp(2048, ge=1)  # tokens per Adam step
    # Cheap update rounds (docs/method/update-cost.md: Cost of the update): each round's closed form and error on a
    # fixed sample of this many tokens (0: all), the best round refitted once on every token at ``precision``
    sketch_tokens: int = hp(16384, ge=0)
    # the rounds' products (Adam steps, the sampled Gram passes): "bf16" inputs with float32 sums, or "full"
    # (``precision``'s); sketch_tokens=0 with "full" is the paper's update
    update_precision: str = hp("bf16", choices=("bf16", "full"))
    # a fresh token sample for each round's closed form, the rounds ranked by a forward pass on the first
    # sample: one fixed sample let the rounds overfit it (docs/method/update-cost.md: Cost of the update)
    sketch_resample: bool = True
    # tokens of that first sample, which ranks the resampled rounds (0: ``sketch_tokens``): a ranking needs fewer
    # tokens than a fit (docs/method/update-cost.md: the per-layer cost)
    rank_tokens: int = hp(0, ge=0)
    # the products of that final refit on every token: "full" (``precision``'s) or "bf16" (``Z`` and ``Y Zᵀ`` from
    # bf16 inputs, ``Z Zᵀ`` a float32 product of the rounded ``Z``, as in the rounds); not a default: it priced
    # a layer whose output energy sits in a few tokens wrongly (docs/method/update-cost.md: the final refit in bf16)
    refit_precision: str = hp("full", choices=("full", "bf16"))

    def rounds(self, problem: LayerProblem) -> Rounds:
        """§3.3's round settings for this layer (its own seed), from the method's fields."""
        return Rounds(iters=self.am_iters, adam_steps=self.adam_steps, lr=self.lr, batch_tokens=self.batch_tokens,
                      damp=self.damp, chunk=problem.chunk, seed=problem.seed + problem.layer_index,
                      lr_scale=self.lr_scale, sketch_tokens=self.sketch_tokens, bf16=self.update_precision == "bf16",
                      resample=self.sketch_resample, rank_tokens=self.rank_tokens,
                      refit_bf16=self.refit_precision == "bf16")

    def inert(self) -> set[str]:
        """The round settings that the others make inert: all but ``am_iters`` without rounds; resampling
        without a token sample or without a closed form to resample for (``gd``); the ranking sample with one fixed
        sample (it ranks the rounds it fits); the final refit's precision where no refit follows the rounds."""
        closed_form = "closed_form" in UPDATES[self.update].needs
        if self.am_iters == 0:
            return {f.name for f in fields(RoundSettings)} - {"am_iters"}
        inert = set()
        if self.sketch_tokens == 0 or not closed_form:
            inert |= {"sketch_resample", "rank_tokens"}
        elif not self.sketch_resample:
            inert.add("rank_tokens")
        if not closed_form or (self.sketch_tokens == 0 and self.update_precision == "full"):
            inert.add("refit_precision")  # no closed-form refit after the rounds (gd), or exact rounds need none
        return inert


UPDATES.register(Update("alternating", frozenset({"refit", "rounds", "closed_form"}), settings=RoundSettings,
                        rounds=_alternating_rounds))
UPDATES.register(Update("gd", frozenset({"refit", "rounds"}), settings=RoundSettings, rounds=_gradient_rounds))
