"""Numerics shared by every method: Gram accumulation and damped symmetric solves.

All least-squares problems here have the form ``min_W ||Y - W Z||_F^2`` with ``Z`` the ``[n, N]``
inputs of the MLP's output projection (the paper's symbols: ``X`` are the MLP's inputs). They only
need ``H = Z Zᵀ`` and ``Y Zᵀ``, accumulated over token chunks by ``gram``, so nothing of size N is kept.

Precision follows ``H``: a method's ``precision`` ("float64", "float32", "tf32"; "auto" resolves per
device) sets the dtype the Gram matrix is accumulated in and every solve runs in. Gram matrices of LLM
activations span many orders of magnitude, so float32 solves are Jacobi-scaled (unit diagonal) and fall back to float64
where the Cholesky factorization still fails. float64 is exact-as-before; float32 is what consumer
GPUs run fast (fp64 there is 1/64 of fp32). ``tf32`` is float32 whose matrix products on CUDA run
on TF32 tensor cores (inputs rounded to a 10-bit mantissa, sums in float32; ~8x the float32 rate on
an H100), for the Gram passes that dominate a large layer's time; on a CPU it is float32.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from .errors import NumericalError


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


@contextmanager
def products(low: bool, device: torch.device):
    """Matrix products of the block with bfloat16 inputs when ``low`` (``torch.autocast``; the kernels
    accumulate in float32), else as they are. bf16 products run 4-5x the float32 rate on a CPU with
    AVX512-BF16 (bench/results/throughput) and 2x TF32's on an H100; used where an approximate
    product is later corrected (the update's intermediate rounds), never for a final fit."""
    if not low:
        yield
        return
    with torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16):
        yield


def gram(mlp, X: torch.Tensor, chunk: int, Y: torch.Tensor | None = None, dtype: torch.dtype = torch.float64,
         low: bool = False):
    """Accumulate ``H = Z̃ Z̃ᵀ`` (and ``Y Z̃ᵀ`` when ``Y`` is given) over token chunks of the MLP inputs
    ``X [N, d]``, ``Z = mlp.hidden(X)`` (``Z̃ = [Z; 1]`` when ``mlp`` has an output bias): float32
    products of each chunk, summed in ``dtype``. With ``low``, ``Z`` and ``Y Z̃ᵀ`` come from bf16 products
    (``products``); ``Z̃ Z̃ᵀ`` stays a float32 product of the rounded ``Z``, so it is still positive
    semidefinite (a bf16-rounded Gram matrix is not, and its damped Cholesky can fail)."""
    bias = mlp.b_out is not None
    n = mlp.width + bias
    H = torch.zeros(n, n, dtype=dtype, device=X.device)
    YZ = None if Y is None else torch.zeros(Y.shape[1], n, dtype=dtype, device=X.device)
    for start in range(0, X.shape[0], chunk):
        with products(low, X.device):
            Z = mlp.hidden(X[start:start + chunk].float())
        Z = augment(Z.float(), bias)
        H += (Z.T @ Z).to(dtype)
        if Y is not None:
            with products(low, X.device):
                YZ += (Y[start:start + chunk].float().T @ Z).to(dtype)
    return H if Y is None else (H, YZ)


def gram_and_outputs(mlp, X: torch.Tensor, chunk: int, dtype: torch.dtype = torch.float64):
    """``H = Z̃ Z̃ᵀ`` and the outputs ``Y = mlp(X)`` (in ``X``'s dtype) from one pass: each chunk's ``Z``
    serves both, so the targets cost one product with the output projection instead of a second forward."""
    bias = mlp.b_out is not None
    n = mlp.width + bias
    H = torch.zeros(n, n, dtype=dtype, device=X.device)
    Y = torch.empty(X.shape[0], mlp.W_out.shape[0], dtype=X.dtype, device=X.device)
    for start in range(0, X.shape[0], chunk):
        Z = mlp.hidden(X[start:start + chunk].float())
        Y[start:start + chunk] = torch.nn.functional.linear(Z, mlp.W_out, mlp.b_out)
        Z = augment(Z, bias)
        H += (Z.T @ Z).to(dtype)
    return H, Y


def sq_norm(Y: torch.Tensor, chunk: int = 8192) -> float:
    """``‖Y‖²`` accumulated in float64 a chunk of rows at a time (no float64 copy of ``Y``)."""
    return sum(float(y.double().pow(2).sum()) for y in Y.split(chunk))


def mean_diag(H: torch.Tensor) -> float:
    return float(torch.diagonal(H).mean().clamp_min(1e-12))


PRECISIONS = {"float64": torch.float64, "float32": torch.float32, "tf32": torch.float32}
# A method's precision hyperparameter: one of PRECISIONS, or "auto" (resolved per device below).
PRECISION_CHOICES = ("auto", *PRECISIONS)


def resolve_precision(precision: str, device) -> str:
    """``auto``: float32 on a CPU (float64 solves cost 1.6x float32's there, and SmolLM2 kept the same
    channels and perplexity, bench/results/precision.md), tf32 on CUDA (measured on an H100: half the time
    of a LLaMA-3.1-8B layer, SmolLM2's perplexity within 0.04% of float64's; bench/results/offload_gpu_h100.md)."""
    if precision != "auto":
        return precision
    return "tf32" if torch.device(device).type == "cuda" else "float32"


@contextmanager
def matmul_precision(precision: str):
    """TF32 tensor-core products for the duration of the block when ``precision == "tf32"`` (CUDA only;
    the global switch is restored afterwards, so nothing else in the process is affected)."""
    if precision != "tf32" or not torch.cuda.is_available():
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def _cholesky(A: torch.Tensor, what: str) -> torch.Tensor:
    L, info = torch.linalg.cholesky_ex(A)
    if int(info) != 0:
        raise NumericalError(
            f"{what} is singular or indefinite (Cholesky failed at pivot {int(info)}). "
            "Increase the damping (damp=...) or use more calibration tokens."
        )
    return L


def solve_spd(A: torch.Tensor, B: torch.Tensor, what: str = "Gram matrix") -> torch.Tensor:
    """``A⁻¹ B`` for symmetric positive definite ``A`` via Cholesky, in ``A``'s dtype.

    float64: as is. float32: ``A`` is scaled in place to unit diagonal, ``S A S`` with
    ``S = diag(A)^-1/2`` (Jacobi), solved, and scaled back; if the float32 factorization fails the
    same scaled system is solved in float64. ``A`` is overwritten in the float32 case.
    """
    B = B.to(A.dtype)
    if A.dtype == torch.float64:
        return torch.cholesky_solve(B, _cholesky(A, what))
    s = A.diagonal().clamp_min(torch.finfo(A.dtype).tiny).rsqrt()
    A.mul_(s[:, None]).mul_(s[None, :])
    L, info = torch.linalg.cholesky_ex(A)
    if int(info) != 0:  # ill-conditioned even after scaling: this one solve in float64
        X = torch.cholesky_solve((B * s[:, None]).double(), _cholesky(A.double(), what)).to(A.dtype)
    else:
        X = torch.cholesky_solve(B * s[:, None], L)
    return X * s[:, None]


def ridge(WH: torch.Tensor, H: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """``W = (Y Zᵀ)(Z Zᵀ + diag(penalty))⁻¹`` given ``WH = Y Zᵀ`` ``[d, n]`` and ``H = Z Zᵀ``, in ``H``'s dtype."""
    A = H.clone()  # H is reused by the caller; the damping goes on the diagonal in place
    A.diagonal().add_(penalty.to(H.dtype))
    return solve_spd(A, WH.T).T.to(WH.dtype)


def lstsq_columns(WH: torch.Tensor, H: torch.Tensor, cols: torch.Tensor, delta: float) -> torch.Tensor:
    """Least-squares refit using only input rows ``cols``: ``(Y Z_Kᵀ)(Z_K Z_Kᵀ + δI)⁻¹``."""
    HK = H[cols][:, cols]
    return ridge(WH[:, cols], HK, torch.full((len(cols),), delta, device=H.device))


def nonfinite_parameters(model: torch.nn.Module) -> list[str]:
    """``"name: k NaN, m Inf"`` for every parameter of ``model`` that is not finite."""
    bad = []
    for name, p in model.named_parameters():
        if p.is_meta:  # not loaded (offload="disk"): checked when its layer is onloaded
            continue
        finite = torch.isfinite(p)
        if not bool(finite.all()):
            nan = int(torch.isnan(p).sum())
            bad.append(f"{name}: {nan} NaN, {int((~finite).sum()) - nan} Inf")
    return bad
