"""The penalty method (SPAP, Hu & Yuan, 2025, Alg. 1): which ``λ`` channels of a layer to remove.

Symbols as in ``spap``: ``W`` the output projection ``[d, n]`` (``W̃ = [W, b]`` with a bias), ``H = Z̃ Z̃ᵀ`` the
Gram matrix of its inputs, ``s ∈ [0,1]ⁿ`` the relaxed mask of the channels to remove. Each iteration marks the
λ lowest scores ``t‖W[:,j]‖² + (1−t)‖W[:,j]‖₁‖Zⱼ‖₂`` (``parts.column_scores``), moves ``s`` toward them,
penalises ``ρ Σⱼ sⱼ‖W[:,j]‖²`` in the closed-form W-step and grows ``ρ``; a hard mask and a least-squares refit
of the kept columns end it. Everything works from ``H`` and ``Y Z̃ᵀ = W₀ H``: no token is read.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from spap_lib.checks import hp
from spap_lib.methods.parts.selection import SELECTIONS, Selection, column_scores
from spap_lib.model.adapters import MLP
from spap_lib.numerics.linalg import mean_diag
from spap_lib.numerics.solve import lstsq_columns, ridge, with_bias


@dataclass(frozen=True)
class Penalty:
    """Alg. 1's settings, named as in the paper: ``ρ0``, ``τ``, the score's ``t``, the soft-mask step ``α``, ``K``
    iterations, and the damping ``δ`` (relative to the mean of ``diag H``); and the s-step's variants."""
    rho0: float
    tau: float
    t: float
    alpha: float
    K: int
    damp: float
    threshold: str = "top"
    scale_free: bool = False
    patience: int = 0


def penalty_method(W0: torch.Tensor, H: torch.Tensor, lam: int, p: Penalty, *,
                   bias: bool) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Alg. 1 on ``W0 [d, n(+1)]`` and ``H = Z̃ Z̃ᵀ``; with ``bias`` the last column/row is the bias.

    ``p.threshold`` is the s-step's rule: ``"top"`` marks the λ lowest scores of this iteration;
    ``"previous"`` is Algorithm 1 as printed, marking every channel whose score falls below
    ``Top_{n−λ}`` of the *previous* iteration's scores (so the count may differ from λ; the hard
    mask at the end removes exactly λ either way).
    Returns the kept channel indices (sorted), the refitted ``W[:, keep (+bias)]`` and diagnostics,
    among them ``moved``: how many removed channels differ from the first score step's choice, and ``iterations``.
    ``p.scale_free``: each score term divided by its mean over the layer (``column_scores``). ``p.patience`` > 0 ends
    the loop once ``s_new`` has marked the same channels at that many consecutive s-steps (0: all K iterations).
    """
    dtype = H.dtype  # the method's precision
    n = H.shape[0] - int(bias)
    scale = mean_diag(H[:n, :n])
    delta = p.damp * scale
    znorm = torch.diagonal(H)[:n].clamp_min(0).sqrt()  # ‖Z_j‖₂ over all calibration tokens
    YZ = W0.to(dtype) @ H  # = Y Z̃ᵀ, since Y = W0 Z̃
    # Alg. 1, input: W ← W0, s ← 0, ρ ← ρ0
    W = W0.to(dtype)
    s = torch.zeros(n, dtype=dtype, device=H.device)
    rho = p.rho0 * scale
    previous, first, marked, stable, k = None, None, None, 0, 0
    for k in range(1, p.K + 1):  # Alg. 1: for k = 1, …, K
        # s-step: s_new marks the columns of lowest score; s moves toward it
        score = column_scores(W[:, :n], znorm, p.t, p.scale_free)
        s_new = torch.zeros_like(s)
        if p.threshold == "previous" and previous is not None and 0 < lam < n:
            # Alg. 1 as printed: s_new_j = 1 iff score_j < Top_{n−λ}(previous scores)
            s_new[score < torch.topk(previous, n - lam).values[-1]] = 1.0
        else:
            s_new[torch.topk(score, lam, largest=False).indices] = 1.0
        if first is None:
            first = torch.topk(score, lam, largest=False).indices  # the first score step's λ channels
        previous = score
        if p.patience:  # the comparison waits for the device: only where it can end the loop
            stable = stable + 1 if marked is not None and torch.equal(s_new, marked) else 0
        marked = s_new
        s = p.alpha * s + (1 - p.alpha) * s_new
        # W-step: W = Y Z̃ᵀ (Z̃ Z̃ᵀ + ρ diag(s) + δI)⁻¹ (the bias column is never penalised)
        penalty = torch.full((H.shape[0],), delta, dtype=dtype, device=H.device)
        penalty[:n] += rho * s
        W = ridge(YZ, H, penalty)
        # ρ ← τρ
        rho *= p.tau
        # The set s_new marks only grows more stable: the penalised columns shrink and score lower still. After
        # ``patience`` unchanged s-steps the rest of the K iterations kept every mask measured
        # (docs/method/update-cost.md: patience).
        if p.patience and stable >= p.patience:
            break
    # Alg. 1, output: the hard mask (the λ channels s marks most strongly; ties go to the lower
    # score), then W refitted on the kept columns only.
    score = column_scores(W[:, :n], znorm, p.t, p.scale_free)
    by_score = torch.argsort(score)
    order = by_score[torch.argsort(-s[by_score], stable=True)]
    keep_mask = torch.ones(n, dtype=torch.bool, device=H.device)
    keep_mask[order[:lam]] = False
    keep = torch.nonzero(keep_mask).flatten()
    cols = with_bias(keep, n, bias)
    W_keep = lstsq_columns(YZ, H, cols, delta)
    removed_first = torch.zeros(n, dtype=torch.bool, device=H.device)
    if first is not None:
        removed_first[first] = True
    info = {"s_on_removed": float(s[order[:lam]].mean()) if lam else 1.0,
            "moved": int((~keep_mask & ~removed_first).sum()), "iterations": k}
    return keep, W_keep, info


@dataclass
class PenaltySettings:
    """Alg. 1's settings (``penalty.Penalty``): what a composition that selects with the penalty method carries."""

    # Defaults chosen on SmolLM2-135M by held-out MLP reconstruction error (docs/parameters.md: SPAP
    # hyperparameters, how each was chosen). The penalty-loop settings barely moved it; lr and rounds did.
    t: float = hp(0.5, ge=0, le=1)  # score mix t‖W_j‖² + (1−t)‖W_j‖₁‖Z_j‖₂ (docs/parameters.md)
    # the score's two terms as they are ("none", the paper) or each divided by its mean over the layer ("layer")
    score_scale: str = hp("none", choices=("none", "layer"))
    alpha: float = hp(0.5, ge=0, lt=1)  # soft mask update s ← αs + (1−α)s_new (α = 1 would never move s)
    rho0: float = hp(1e-2, gt=0)  # initial penalty, in units of mean(diag(Z Zᵀ))
    tau: float = hp(1.5, ge=1)  # penalty growth ρ ← τρ
    K: int = hp(20, ge=1)  # penalty iterations; ρ grows by τᴷ (docs/parameters.md: how each was chosen)
    # End the loop once s_new has marked the same channels at this many consecutive s-steps (0: all K, the paper).
    # 3 kept every measured layer's channels in fewer solves (docs/method/update-cost.md: patience)
    patience: int = hp(0, ge=0)
    # s-step rule: "top" = the λ lowest scores; "previous" = Alg. 1 as printed (below Top_{n−λ} of the
    # previous iteration's scores)
    threshold: str = hp("top", choices=("top", "previous"))

    def penalty(self, dense: MLP, H: torch.Tensor, n_remove: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Alg. 1 with these settings on the dense MLP's Gram matrix ``H`` (``penalty_method``)."""
        settings = Penalty(rho0=self.rho0, tau=self.tau, t=self.t, alpha=self.alpha, K=self.K, damp=self.damp,
                           threshold=self.threshold, scale_free=self.score_scale == "layer", patience=self.patience)
        return penalty_method(dense.out_augmented(), H, n_remove, settings, bias=dense.b_out is not None)


# The selection: Alg. 1 on the layer's Gram matrix; for an allocation, its first s-step's score on dense statistics.
SELECTIONS.register(Selection(
    "penalty", frozenset({"solves"}), settings=PenaltySettings,
    score=lambda m, mlp, stats: column_scores(mlp.W_out.double(), stats.norm, m.t, m.score_scale == "layer"),
    choose=lambda m, problem: m.penalty(problem.dense, problem.H, problem.n_remove)))
