"""Numerics shared by every method: Gram accumulation, chunked products and the precision they run in.

All least-squares problems here have the form ``min_W ||Y - W Z||_F^2`` with ``Z`` the ``[n, N]``
inputs of the MLP's output projection (the paper's symbols: ``X`` are the MLP's inputs). They only
need ``H = Z Zᵀ`` and ``Y Zᵀ``, accumulated over token chunks by ``gram``, so nothing of size N is kept.

Precision follows ``H``: a method's ``precision`` ("float64", "float32", "tf32"; "auto" resolves per
device) sets the dtype the Gram matrix is accumulated in and every solve runs in. Gram matrices of LLM
activations span many orders of magnitude, so float32 solves are Jacobi-scaled (unit diagonal) and fall back to float64
where the Cholesky factorization still fails. float64 is exact-as-before; float32 is what consumer
GPUs run fast (fp64 there is 1/64 of fp32). ``tf32`` is float32 whose matrix products on CUDA run
on TF32 tensor cores (inputs rounded to a 10-bit mantissa, sums in float32; docs/scale.md: Numerics that fit
GPUs), for the Gram passes that dominate a large layer's time; on a CPU it is float32.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from spap_lib.errors import NumericalError
from spap_lib.numerics import bf16
from spap_lib.numerics.collective import all_sum, all_sum_


def augment(Z: torch.Tensor, bias: bool) -> torch.Tensor:
    """Append a column of ones to tokens ``Z [N, n]`` so a bias becomes one more weight column."""
    if not bias:
        return Z
    return torch.cat([Z, torch.ones(Z.shape[0], 1, dtype=Z.dtype, device=Z.device)], dim=1)


def nonfinite(T: torch.Tensor, block: int = 2**22) -> tuple[int, int]:
    """How many NaN and Inf values ``T`` holds, ``block`` elements at a time: ``torch.isfinite`` of a whole tensor
    materialises ``|T|`` and two masks of the whole tensor, where a block's temporaries are ``block`` elements each
    (docs/scale.md: the 1.5B host-memory target)."""
    nan = inf = 0
    for b in T.detach().reshape(-1).split(block):
        if not bool(torch.isfinite(b).all()):
            nan, inf = nan + int(torch.isnan(b).sum()), inf + int(torch.isinf(b).sum())
    return nan, inf


def check_finite(H: torch.Tensor, what: str) -> None:
    """Refuse NaN/Inf in ``H``, saying which tensor (and layer) and how many values."""
    nan, inf = nonfinite(H)
    if nan or inf:
        raise NumericalError(
            f"{what} contain {nan} NaN and {inf} Inf values ({H.dtype}): the calibration "
            "activations overflowed or the weights upstream are not finite. Run in float32 (dtype='float32') "
            "or check the model weights."
        )


@contextmanager
def products(in_bf16: bool, device: torch.device):
    """Matrix products of the block with bfloat16 inputs when ``in_bf16`` (``torch.autocast``; the kernels
    accumulate in float32), else as they are. bf16 products outrun float32's on a CPU with AVX512-BF16 and TF32's on
    an H100 (docs/scale.md: Numerics that fit GPUs); on a CPU without bf16 units the same
    products come from the float32 kernels (``bf16.autocast``). Used where an approximate product is later
    corrected (the update's intermediate rounds), never for a final fit."""
    if not in_bf16:
        yield
        return
    with bf16.autocast(device):  # on a CPU without bf16 units, the float32 kernels on rounded operands
        yield


@contextmanager
def exact_bf16_products(in_bf16: bool, device: torch.device):
    """float32 products of operands that are already bf16 values (``Z`` from ``products``) computed by the CPU's
    bf16 units, with float32 sums and outputs (oneDNN's bf16 math mode; CUDA's TF32 products already take bf16
    values exactly). A product of two bf16 values is exact in float32, so the result is the float32 product up to
    the order of its sums, at a higher rate on a CPU with AVX512-BF16 (docs/method/update-cost.md: the savings that
    leave the answer as it was). Where an operand is not a bf16 value it is rounded to one: use only on rounded
    operands. Off where the CPU has no bf16 units (``bf16.rounded``): oneDNN's bf16 mode there is slower than the
    float32 kernels, whose products of these operands are the same numbers."""
    cpu = torch.device(device).type == "cpu"
    if not in_bf16 or not cpu or not torch.backends.mkldnn.is_available() or bf16.rounded(device):
        yield
        return
    old = torch.backends.mkldnn.matmul.fp32_precision
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    try:
        yield
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = old


def rows(T: torch.Tensor, start: int, stop: int, device: torch.device) -> torch.Tensor:
    """Rows ``start:stop`` of ``T`` on ``device``. Calibration activations may wait in (pinned) host memory while
    the layer is on a GPU (offloaded runs: ``Onloader.calibration``); every pass over them moves one chunk at a
    time, so the device never holds all N tokens. Where ``T`` is on ``device`` already this is a view."""
    return T[start:stop].to(device, non_blocking=True)


def like(T: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """An empty tensor of ``shape`` where ``T`` waits (its device, dtype and pinning): the dense targets beside
    the inputs they come from."""
    return torch.empty(shape, dtype=T.dtype, device=T.device, pin_memory=T.is_pinned())


# The Gram matrix is symmetric, so a pass multiplies each block of its rows only with the columns from that block's
# diagonal on, and ``mirror`` copies the upper triangle down once the pass is done: (B+1)/(2B) of the full product's
# work for B blocks. Eight blocks do 9/16 of the work in products still large enough to run at full rate, so a pass
# outruns the whole product (docs/method/update-cost.md: exact savings).
GRAM_BLOCKS = 8


# A pass over the calibration tokens holds a chunk's activations, two ``[chunk, n]`` float32 tensors at their peak
# (``MLP.hidden``). ``chunk_for`` keeps them under this many bytes: the default 8,192 tokens up to n = 5,120
# (SmolLM2, Gemma-3-270M and Qwen2.5-0.5B pass in chunks of 8,192), fewer at wider layers (Qwen2.5-1.5B's
# n = 8,960: 4,681 tokens; a 70B layer's n = 28,672: 1,462), where each product is still large enough to run at
# full rate.
CHUNK_BYTES = 320 * 2**20


def chunk_for(n: int, chunk: int) -> int:
    """Tokens per pass over the calibration tokens at MLP width ``n``: ``chunk``, or fewer where a chunk's two
    activations would pass ``CHUNK_BYTES``. Only sums' order depends on it, never what is computed."""
    return max(1, min(chunk, CHUNK_BYTES // (2 * n * 4)))


def gram_flops(N: int, n: int) -> float:
    """What the plan counts for ``Zᵀ Z`` over ``N`` tokens of width ``n``: the whole product's operations. In a real
    pass the blocks save less than their share of the work (docs/method/update-cost.md: exact savings), so the rates
    measured on whole products, and the GPU terms fitted to layers timed with them, keep pricing it."""
    return 2 * N * n * n


def add_gram(H: torch.Tensor, Z: torch.Tensor) -> None:
    """``H += Zᵀ Z`` on and above the diagonal (``mirror`` completes ``H`` after the last chunk), one block of rows at
    a time: ``GRAM_BLOCKS`` blocks, none taller than ``Z`` has tokens, so the temporary is a block of the product
    (at most the size of ``Z``), never a second ``n × n`` matrix (docs/scale.md: Memory per layer). Any block
    size fills the upper triangle, so chunks of different sizes may be added to one ``H``."""
    n = H.shape[0]
    block = max(1, min(Z.shape[0], -(-n // GRAM_BLOCKS)))
    for i in range(0, n, block):
        H[i:i + block, i:] += (Z[:, i:i + block].T @ Z[:, i:]).to(H.dtype)


def mirror(H: torch.Tensor) -> torch.Tensor:
    """``H``'s upper triangle copied onto its lower one in place (exactly symmetric after ``add_gram``), a block of
    rows at a time (temporaries of one diagonal block)."""
    n = H.shape[0]
    block = -(-n // GRAM_BLOCKS)
    for i in range(0, n, block):
        j = min(i + block, n)
        D = H[i:j, i:j]
        D.copy_(torch.triu(D) + torch.triu(D, 1).T)
        H[j:, i:j] = H[i:j, j:].T
    return H


def gram(mlp, X: torch.Tensor, chunk: int, Y: torch.Tensor | None = None, dtype: torch.dtype = torch.float64,
         in_bf16: bool = False, weigh: str | torch.Tensor | None = None, each=None):
    """Accumulate ``H = Z̃ Z̃ᵀ`` (and ``Y Z̃ᵀ`` when ``Y`` is given) over token chunks of the MLP inputs
    ``X [N, d]``, ``Z = mlp.hidden(X)`` (``Z̃ = [Z; 1]`` when ``mlp`` has an output bias), on the MLP's device
    (``X`` and ``Y`` may wait elsewhere: ``rows``): float32 products of each chunk, summed in ``dtype``. With
    ``in_bf16``, ``Z`` and ``Y Z̃ᵀ`` come from bf16 products (``products``); ``Z̃ Z̃ᵀ`` stays a float32 product of
    the rounded ``Z``, so it is still positive semidefinite (a bf16-rounded Gram matrix is not, and its damped
    Cholesky can fail). With ``weigh="output"``, each token's ``z̃`` is divided by the norm of its own output
    ``‖mlp(x)‖``: then ``⟨W H, W⟩`` and ``W H`` are the output errors and targets of every token relative to its
    own output energy, so a few tokens with massive outputs do not outweigh the rest. With ``weigh`` a tensor of
    ``[N]`` reference energies (aligned with ``X``'s rows), each ``z̃`` is divided by ``√reference`` instead: the
    errors of every token relative to, e.g., the hidden state its output is added to. ``each`` is called with
    every chunk's ``Z`` as computed (before the ones row and any weighting), so that a second sum over the same
    activations needs no second forward (the error curve's channel statistics, ``ChannelStats.add``)."""
    bias = mlp.b_out is not None
    n, device = mlp.width + bias, mlp.W_out.device
    H = torch.zeros(n, n, dtype=dtype, device=device)
    YZ = None if Y is None else torch.zeros(Y.shape[1], n, dtype=dtype, device=device)
    reference = weigh if isinstance(weigh, torch.Tensor) else None
    W = mlp.out_augmented().float() if isinstance(weigh, str) and weigh == "output" else None  # outputs weigh tokens
    for start in range(0, X.shape[0], chunk):
        with products(in_bf16, device):
            Z = mlp.hidden(rows(X, start, start + chunk, device).float())
        if each is not None:
            each(Z)
        Z = augment(Z.float(), bias)
        if W is not None or reference is not None:  # a (near) zero reference is floored, never divided by
            e = energies(Z @ W.T) if reference is None else rows(reference, start, start + chunk, device).double()
            Z = Z * e.clamp_min(1e-12 * float(e.mean()) + torch.finfo(torch.float64).tiny).rsqrt().float()[:, None]
        with exact_bf16_products(in_bf16, device):  # with ``in_bf16``, Z holds bf16 values
            add_gram(H, Z)
        if Y is not None:
            with products(in_bf16, device):
                YZ += (rows(Y, start, start + chunk, device).float().T @ Z).to(dtype)
    all_sum_(H)  # over the ranks' tokens (``collective``): the identity in one process
    mirror(H)
    return H if Y is None else (H, all_sum_(YZ))


def gram_and_outputs(mlp, X: torch.Tensor, chunk: int, dtype: torch.dtype = torch.float64):
    """``H = Z̃ Z̃ᵀ`` and the outputs ``Y = mlp(X)`` (in ``X``'s dtype, where ``X`` waits) from one pass: each
    chunk's ``Z`` serves both, so the targets cost one product with the output projection instead of a second
    forward."""
    bias = mlp.b_out is not None
    n, device = mlp.width + bias, mlp.W_out.device
    H = torch.zeros(n, n, dtype=dtype, device=device)
    Y = like(X, (X.shape[0], mlp.W_out.shape[0]))
    for start in range(0, X.shape[0], chunk):
        Z = mlp.hidden(rows(X, start, start + chunk, device).float())
        # rounded to Y's dtype where it is computed: a float32 chunk bound for host memory would cross the link
        # at twice the bytes and be converted there
        Y[start:start + chunk] = torch.nn.functional.linear(Z, mlp.W_out, mlp.b_out).to(Y.dtype)
        add_gram(H, augment(Z, bias))
    return mirror(all_sum_(H)), Y


def outputs(mlp, X: torch.Tensor, chunk: int) -> torch.Tensor:
    """``mlp(X)`` in ``X``'s dtype, where ``X`` waits, a chunk at a time on the MLP's device."""
    Y = like(X, (X.shape[0], mlp.W_out.shape[0]))
    for start in range(0, X.shape[0], chunk):
        Y[start:start + chunk] = mlp(rows(X, start, start + chunk, mlp.W_out.device).float()).to(Y.dtype)
    return Y


def energies(T: torch.Tensor) -> torch.Tensor:
    """``‖t‖²`` of every row of ``T`` in float64: each row's squares summed in float32 (a few thousand of them, the
    sum's relative error ~1e-7), the rows' sums kept in float64. A float64 copy squared and summed gives the same
    digits up to ~1e-9 and ran slower on a CPU, where it was most of the update rounds' time outside the products
    (docs/method/update-cost.md: the savings that leave the answer as it was)."""
    return T.float().square().sum(1).double()


def token_energies(T: torch.Tensor, chunk: int, device, mlp=None) -> torch.Tensor:
    """``‖t‖²`` of every row of ``T`` ``[N]`` in float64 (on the CPU), a chunk at a time on ``device``; with ``mlp``,
    ``‖mlp(t)‖²``: the MLP's output energy per token, the outputs never kept."""
    def energy(s: int) -> torch.Tensor:
        block = rows(T, s, s + chunk, device)
        return energies(block if mlp is None else mlp(block.float())).cpu()
    return torch.cat([energy(s) for s in range(0, T.shape[0], chunk)])


def top_share(energies: torch.Tensor, fraction: float = 0.01) -> float:
    """The share of the summed ``energies`` that their largest ``fraction`` hold (at least one)."""
    k = max(1, int(fraction * len(energies)))
    return float(torch.topk(energies, k).values.sum() / energies.sum().clamp_min(torch.finfo(torch.float64).tiny))


def sq_norm(Y: torch.Tensor, chunk: int = 8192, device=None) -> float:
    """``‖Y‖²`` in float64, a chunk of rows at a time on ``device`` (default: ``Y``'s; no float64 copy of ``Y``),
    over every rank's rows."""
    return all_sum(float(token_energies(Y, chunk, Y.device if device is None else device).sum()))


def mean_diag(H: torch.Tensor) -> float:
    return float(torch.diagonal(H).mean().clamp_min(1e-12))


PRECISIONS = {"float64": torch.float64, "float32": torch.float32, "tf32": torch.float32}


# A method's precision hyperparameter: one of PRECISIONS, or "auto" (resolved per device below).
PRECISION_CHOICES = ("auto", *PRECISIONS)


def resolve_precision(precision: str, device) -> str:
    """``auto``: float32 on a CPU (float64 solves cost more there, and SmolLM2 kept the same channels and
    perplexity), tf32 on CUDA (less time than float64 at nearly its perplexity); docs/scale.md: Numerics that fit
    GPUs."""
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


def nonfinite_parameters(model: torch.nn.Module) -> list[str]:
    """``"name: k NaN, m Inf"`` for every parameter of ``model`` that is not finite."""
    bad = []
    for name, p in model.named_parameters():
        if p.is_meta:  # not loaded (offload="disk"): checked when its layer is onloaded
            continue
        nan, inf = nonfinite(p)
        if nan or inf:
            bad.append(f"{name}: {nan} NaN, {inf} Inf")
    return bad
