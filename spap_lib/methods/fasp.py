"""FASP (Hu et al., 2025, arXiv:2501.09412): Wanda-style column score + least-squares restoration.

Per MLP: score output-projection columns by FASP's pruning metric ``S_j = Σ_i |W_ij|·‖Z_j‖₂`` (the
Wanda metric summed over a column), remove the lowest together with the matching input-projection
rows, then apply FASP's restoration step: the kept columns refitted in closed form,
``W_K = Y Z_Kᵀ (Z_K Z_Kᵀ + δI)⁻¹``, from the Gram matrix. Layers are pruned in sequence on the
activations of the already pruned ones, like SPAP (whose t = 0 score is exactly this metric).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import hp
from ..linalg import PRECISION_CHOICES, lstsq_columns, mean_diag
from .base import LayerProblem, Method, PruneResult, register


@register
@dataclass
class FASP(Method):
    name = "fasp"
    precision: str = hp("auto", choices=PRECISION_CHOICES)  # Gram sums and solves, as SPAP's
    damp: float = hp(1e-3, ge=0)  # δ = damp·mean(diag(Z Zᵀ)), the same damping as SPAP's solves

    def prune(self, problem: LayerProblem) -> PruneResult:
        dense, H = problem.dense, problem.H
        n = dense.width
        xnorm = torch.diagonal(H)[:n].clamp_min(0).sqrt()
        score = dense.W_out.double().abs().sum(0) * xnorm
        keep = torch.sort(torch.topk(score, n - problem.n_remove).indices).values
        cols = torch.cat([keep, keep.new_tensor([n])]) if problem.has_bias else keep
        W0 = dense.out_augmented().to(H.dtype)
        mlp = dense.select(keep)
        mlp.set_out_augmented(lstsq_columns(W0 @ H, H, cols, self.damp * mean_diag(H[:n, :n])))
        return PruneResult(mlp=mlp, keep=keep)
