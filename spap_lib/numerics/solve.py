"""Damped symmetric solves and least-squares fits on Gram statistics (``linalg.gram``).

``solve_spd`` factors with Cholesky; float32 systems are Jacobi-scaled and fall back to float64 where the
factorization still fails (docs/scale.md: Numerics that fit GPUs). ``ridge``, ``lstsq_columns`` and
``nested_lstsq_errors`` are the closed-form updates the methods share; ``reconstruction_error`` is
``‖Y − W Z̃‖²`` from the statistics.
"""
from __future__ import annotations

import torch

from spap_lib.errors import NumericalError
from spap_lib.numerics.linalg import GRAM_BLOCKS


def _factor(A: torch.Tensor) -> int:
    """Cholesky factorisation of symmetric ``A`` in ``A``'s own memory; the failed pivot, 0 on success.

    LAPACK and cuSOLVER factorise column-major storage, and ``A.mT`` of a row-major ``A`` is that: nothing is
    copied (``torch.linalg.cholesky(A)`` factorises a copy and ``cholesky_solve`` copies the factor again, three
    ``n × n`` buffers where one serves). The factor reads the lower triangle of ``A.mT``, the upper of ``A``. Where
    ``A`` is symmetric to the bit (a Gram sum of float32 products on this project's CPUs: each entry the same sums
    of the same products as its mirror) that is the factor of a copy, bit for bit; elsewhere the two triangles
    differ by rounding, and so do the factors. Afterwards ``A.mT`` holds the lower factor ``L``."""
    M = A.mT
    info = torch.empty((), dtype=torch.int32, device=A.device)
    torch.linalg.cholesky_ex(M, out=(M, info))
    return int(info)


def _solve_factored(A: torch.Tensor, B: torch.Tensor) -> torch.Tensor:
    """``(L Lᵀ)⁻¹ B`` for the factor ``_factor`` left in ``A`` (two triangular solves, what ``cholesky_solve``
    does, without its copy of the factor)."""
    L = A.mT
    return torch.linalg.solve_triangular(L.mT, torch.linalg.solve_triangular(L, B, upper=False), upper=True)


def _singular(what: str, pivot: int) -> NumericalError:
    return NumericalError(f"{what} is singular or indefinite (Cholesky failed at pivot {pivot}). "
                          "Increase the damping (damp=...) or use more calibration tokens.")


def _jacobi(A: torch.Tensor) -> torch.Tensor:
    """Scale ``A`` in place to unit diagonal, ``S A S`` with ``S = diag(A)^-1/2``; returns ``diag(S)``. Entry
    ``(i, j)`` becomes ``(a_ij s_j) s_i``: in the upper triangle, which ``_factor`` reads, exactly the
    ``(a_ji s_j) s_i`` of the lower one that factorising a copy would read."""
    s = A.diagonal().clamp_min(torch.finfo(A.dtype).tiny).rsqrt()
    A.mul_(s[None, :]).mul_(s[:, None])
    return s


def solve_spd(A: torch.Tensor, B: torch.Tensor, what: str = "Gram matrix", again=None) -> torch.Tensor:
    """``A⁻¹ B`` for symmetric positive definite ``A`` via Cholesky, in ``A``'s dtype. ``A`` is overwritten: it
    holds its own factor (``_factor``), so a solve needs no ``n × n`` buffer beyond ``A``.

    float64: as is. float32: ``A`` is scaled to unit diagonal (``_jacobi``), solved, and scaled back; where the
    float32 factorisation fails the same scaled system is solved in float64, from ``again()`` (``A`` built anew;
    ``ridge`` passes it) or else from a copy of ``A`` kept beforehand.
    """
    B = B.to(A.dtype)
    if A.dtype == torch.float64:
        pivot = _factor(A)
        if pivot:
            raise _singular(what, pivot)
        return _solve_factored(A, B)
    spare = A.clone() if again is None else None
    s = _jacobi(A)
    if not _factor(A):
        return _solve_factored(A, B * s[:, None]) * s[:, None]
    # ill-conditioned even after scaling: this one solve in float64
    A = spare if spare is not None else again()
    _jacobi(A)
    A = A.double()
    pivot = _factor(A)
    if pivot:
        raise _singular(what, pivot)
    return _solve_factored(A, (B * s[:, None]).double()).to(B.dtype) * s[:, None]


def _damped_solve(WH: torch.Tensor, system, penalty: torch.Tensor) -> torch.Tensor:
    """``WH (S + diag(penalty))⁻¹`` for the Gram matrix ``S = system()``, a fresh copy each call: the damping goes
    on its diagonal and the solve factorises it in place; a failed float32 factorisation builds it again."""
    def damped() -> torch.Tensor:
        A = system()
        A.diagonal().add_(penalty.to(A.dtype))
        return A

    return solve_spd(damped(), WH.T, again=damped).T.to(WH.dtype)


def ridge(WH: torch.Tensor, H: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """``W = (Y Zᵀ)(Z Zᵀ + diag(penalty))⁻¹`` given ``WH = Y Zᵀ`` ``[d, n]`` and ``H = Z Zᵀ``, in ``H``'s dtype.
    ``H`` is kept (the caller reuses it): its damped copy is the one buffer the solve factorises."""
    return _damped_solve(WH, H.clone, penalty)


def lstsq_columns(WH: torch.Tensor, H: torch.Tensor, cols: torch.Tensor, delta: float,
                  toward: torch.Tensor | None = None, pull: float = 0.0) -> torch.Tensor:
    """Least-squares refit using only input rows ``cols``: ``(Y Z_Kᵀ)(Z_K Z_Kᵀ + δI)⁻¹``. With ``pull`` > 0 the refit
    is drawn toward ``toward``'s columns ``W₀_K``, ``min ‖Y − W Z_K‖² + pull·‖W − W₀_K‖²``:
    ``(Y Z_Kᵀ + pull·W₀_K)(Z_K Z_Kᵀ + (δ + pull)I)⁻¹``."""
    B = WH[:, cols] + pull * toward[:, cols] if pull else WH[:, cols]
    # H's kept block gathered in one step: no n_keep × n intermediate
    return _damped_solve(B, lambda: H[cols[:, None], cols], torch.full((len(cols),), delta + pull, device=H.device))


def nested_lstsq_errors(WH: torch.Tensor, H: torch.Tensor, order: torch.Tensor, sizes: list[int], delta: float,
                        YY: float, toward: torch.Tensor | None = None, pull: float = 0.0) -> list[float]:
    """``‖Y − W_k Z_k‖²`` for ``lstsq_columns``'s refit on each leading set ``order[:k]`` of the input rows, ``k`` in
    ``sizes`` (``YY = ‖Y‖²``), from one float64 factorisation instead of one solve per set. Permuted into ``order``,
    the damped system ``A = H + (δ + pull)I`` has the factor of every leading block as the leading block of its
    factor ``L``, and the forward solve ``V = L⁻¹ Bᵀ`` (``B = Y Zᵀ + pull·W₀``) the same property: ``⟨W_k, B_k⟩ =
    ‖V_k‖²``. With ``W_k A_k = B_k`` the error is ``‖Y‖² − ‖V_k‖² + 2·pull·⟨W_k, W₀_k⟩ − (δ + pull)‖W_k‖²``, where
    ``W_k`` costs one triangular solve with the leading block. That is a difference of nearly equal terms whose
    rounding enters at first order (a refit's own rounding would only at second), hence float64: the copy of ``H``
    it factorises is twice ``H``'s float32 size. Raises ``NumericalError`` where ``A`` is not positive definite."""
    B = WH[:, order] + pull * toward[:, order] if pull else WH[:, order]
    A = torch.empty(len(order), len(order), dtype=torch.float64, device=H.device)
    block = -(-len(order) // GRAM_BLOCKS)
    for i in range(0, len(order), block):  # gathered a block of rows at a time: no float32 copy of the whole matrix
        A[i:i + block] = H[order[i:i + block, None], order]
    A.diagonal().add_(delta + pull)
    pivot = _factor(A)
    if pivot:
        raise _singular("the error curve's Gram matrix", pivot)
    L = A.mT
    V = torch.linalg.solve_triangular(L, B.T.double(), upper=False)
    W0 = toward[:, order].double().T if pull else None
    errors = []
    for k in sizes:
        Vk = V[:k]
        Wk = torch.linalg.solve_triangular(L[:k, :k].mT, Vk, upper=True)  # W_kᵀ
        error = YY - float(Vk.square().sum()) - (delta + pull) * float(Wk.square().sum())
        errors.append(error + (2 * pull * float((Wk * W0[:k]).sum()) if pull else 0.0))
    return errors


# Rows of W (and columns of H) per float64 block of ``reconstruction_error``: every MLP up to this hidden size is one
# block of rows, and a block's float64 copies are then W's own size at most; past it they stay a block's size, not a
# whole float64 W: the error runs in the final refit, beside everything else (docs/scale.md: Streaming X and Y on a
# GPU, measured).
ERROR_BLOCK = 1024


def reconstruction_error(W: torch.Tensor, H: torch.Tensor, YZ: torch.Tensor, YY: float) -> float:
    """``‖Y − W Z̃‖²`` from Gram statistics: ``‖Y‖² − 2⟨W, Y Z̃ᵀ⟩ + ⟨W H, W⟩``, in float64 whatever the precision
    (a difference of large, nearly equal terms). ``W``, ``Y Z̃ᵀ`` and ``H`` go to float64 a block at a time
    (``ERROR_BLOCK`` rows of ``W``, as many columns of ``H``): never a float64 copy of a whole matrix."""
    block = min(W.shape[0], ERROR_BLOCK)
    linear = quadratic = 0.0
    for i in range(0, W.shape[0], block):
        Wi = W[i:i + block].double()
        linear += float((Wi * YZ[i:i + block].double()).sum())
        quadratic += sum(float(((Wi @ H[:, j:j + block].double()) * Wi[:, j:j + block]).sum())
                         for j in range(0, H.shape[1], block))
    return float(YY - 2 * linear) + quadratic


def with_bias(keep: torch.Tensor, n: int, bias: bool) -> torch.Tensor:
    """The columns of ``W̃ = [W, b]`` that the kept channels ``keep`` use: the bias column ``n`` too, if any."""
    return torch.cat([keep, keep.new_tensor([n])]) if bias else keep
