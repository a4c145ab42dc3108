"""Numerics shared by every method: Gram accumulation and damped symmetric solves.

All least-squares problems here have the form ``min_W ||Y - W X||_F^2`` with ``X`` the ``[n, N]``
inputs of a linear map. They only need ``H = X Xᵀ`` and ``Y Xᵀ``, so nothing of size N is kept.
Solves run in float64: Gram matrices of LLM activations span many orders of magnitude.
"""
from __future__ import annotations

import torch


class NumericalError(RuntimeError):
    """A Gram matrix that is not finite or not positive definite even after damping."""


def augment(Z: torch.Tensor, bias: bool) -> torch.Tensor:
    """Append a column of ones to tokens ``Z [N, n]`` so a bias becomes one more weight column."""
    if not bias:
        return Z
    return torch.cat([Z, torch.ones(Z.shape[0], 1, dtype=Z.dtype, device=Z.device)], dim=1)


def check_finite(H: torch.Tensor, what: str) -> None:
    """Refuse NaN/Inf in ``H``, saying which tensor (and layer) and how many values."""
    bad = ~torch.isfinite(H)
    if bad.any():
        nan = int(torch.isnan(H).sum())
        raise NumericalError(
            f"{what} contain {nan} NaN and {int(bad.sum()) - nan} Inf values ({H.dtype}): the calibration "
            "activations overflowed or the weights upstream are not finite. Run in float32 (dtype='float32') "
            "or check the model weights."
        )


def mean_diag(H: torch.Tensor) -> float:
    return float(torch.diagonal(H).mean().clamp_min(1e-12))


def solve_spd(A: torch.Tensor, B: torch.Tensor, what: str = "Gram matrix") -> torch.Tensor:
    """``A⁻¹ B`` for symmetric positive definite ``A`` via Cholesky (float64)."""
    A64, B64 = A.double(), B.double()
    L, info = torch.linalg.cholesky_ex(A64)
    if int(info) != 0:
        raise NumericalError(
            f"{what} is singular or indefinite (Cholesky failed at pivot {int(info)}). "
            "Increase the damping (damp=...) or use more calibration tokens."
        )
    return torch.cholesky_solve(B64, L)


def ridge(WH: torch.Tensor, H: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """``W = (Y Xᵀ)(X Xᵀ + diag(penalty))⁻¹`` given ``WH = Y Xᵀ`` ``[d, n]`` and ``H = X Xᵀ``."""
    A = H.double() + torch.diag(penalty.double())
    return solve_spd(A, WH.double().T).T.to(WH.dtype)


def lstsq_columns(WH: torch.Tensor, H: torch.Tensor, cols: torch.Tensor, delta: float) -> torch.Tensor:
    """Least-squares refit using only input rows ``cols``: ``(Y X_Kᵀ)(X_K X_Kᵀ + δI)⁻¹``."""
    HK = H[cols][:, cols]
    return ridge(WH[:, cols], HK, torch.full((len(cols),), delta, device=H.device))


def nonfinite_parameters(model: torch.nn.Module) -> list[str]:
    """``"name: k NaN, m Inf"`` for every parameter of ``model`` that is not finite."""
    bad = []
    for name, p in model.named_parameters():
        finite = torch.isfinite(p)
        if not bool(finite.all()):
            nan = int(torch.isnan(p).sum())
            bad.append(f"{name}: {nan} NaN, {int((~finite).sum()) - nan} Inf")
    return bad
