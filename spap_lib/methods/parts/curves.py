"""One layer's error curve, for the error allocation: the relative reconstruction error once ``r`` channels are
removed, at a few ``r``, from one Gram pass and one factorisation (``nested_lstsq_errors``).

``composition.Composition.error_curve`` calls this with itself as ``m``: its selection's score, refit and curve
settings.
"""
from __future__ import annotations

import torch

from spap_lib.methods.base import Method
from spap_lib.model.adapters import MLP
from spap_lib.numerics.collective import subsample, total
from spap_lib.numerics.linalg import PRECISIONS, check_finite, gram, matmul_precision, mean_diag, resolve_precision
from spap_lib.numerics.solve import nested_lstsq_errors, reconstruction_error, with_bias
from spap_lib.numerics.stats import ChannelStats


def error_curve(m: Method, mlp: MLP, X: torch.Tensor, chunk: int, residual: torch.Tensor | None = None,
                stats: ChannelStats | None = None) -> tuple[ChannelStats, list[tuple[int, float]]]:
    """The dense layer's channel statistics and its curve ``(r, e)``: the relative reconstruction error ``e`` once
    ``r`` channels are removed, at ``curve_points(n)``, on ``error_tokens`` of its inputs ``X`` (``error_weight``:
    every token's error relative to its own output energy, or the layer's summed, or (``"residual"``) the mean of
    every token's error relative to ``residual``, the energies ``[N]`` of the hidden states the layer's outputs
    are added to, aligned with ``X``'s rows). Channels are ranked once by the selection's score on the layer's
    dense statistics (``allocation_scores``; the penalty method: its first s-step), and the kept columns are
    refitted by least squares (update ``none``: the dense weights). The kept sets are nested, so every point's
    refit comes from one factorisation (``nested_lstsq_errors``). The "error" allocation spends the budget where
    these curves are flattest.

    The statistics are ``stats`` where given; otherwise the curve's Gram pass sums them from its own ``Z`` when it
    reads every token (no second forward over them: the same sums as ``ChannelStats.of``, from TF32 products where
    the precision is tf32), and a pass of their own takes them over every token when it reads a sample."""
    precision = resolve_precision(m.precision, mlp.W_out.device)
    weight = m.error_weight
    if weight == "residual" and residual is None:
        raise ValueError("error_weight='residual' needs the energies of the hidden states the outputs are added to")
    Xe, reference = subsample(X, residual.to(X.device) if weight == "residual" else None, m.error_tokens, seed=0)
    if stats is None and Xe is not X:
        stats = ChannelStats.of(mlp, X, chunk)
    taken = ChannelStats.empty(mlp.width, mlp.W_out.device) if stats is None else None
    with matmul_precision(precision):
        weigh = reference if reference is not None else "output" if weight == "token" else None
        H = gram(mlp, Xe, chunk, dtype=PRECISIONS[precision], weigh=weigh, each=None if taken is None else taken.add)
    stats = taken.summed() if stats is None else stats
    check_finite(H, "the error curve's Gram matrix entries")
    n, bias = mlp.width, mlp.b_out is not None
    order = torch.argsort(m.allocation_scores(mlp, stats), descending=True).to(H.device)  # best first
    W0 = mlp.out_augmented().to(H.dtype)
    YZ = W0 @ H  # Y Z̃ᵀ with Y = W0 Z̃
    YY = max(float((YZ.double() * W0.double()).sum()), torch.finfo(torch.float64).tiny)  # ‖Y‖² = ⟨W0 H, W0⟩
    # "residual": the errors relative to the residual stream, averaged over the tokens, in the same units in
    # every layer; the others: relative to the layer's own (weighted) output energy
    norm = total(Xe.shape[0]) if weight == "residual" else YY
    scale = mean_diag(H[:n, :n])
    points = curve_points(n)
    if not m.refits:  # the dense weights of the kept columns
        errors = [reconstruction_error(W0[:, cols], H[cols][:, cols], YZ[:, cols], YY)
                  for cols in (with_bias(torch.sort(order[:n - r]).values, n, bias) for r in points)]
    else:  # the least-squares refit of every point from one factorisation (the kept sets are nested)
        nested = torch.cat([order.new_tensor([n]), order]) if bias else order  # the bias column is always kept
        errors = nested_lstsq_errors(YZ, H, nested, [n - r + bias for r in points], m.damp * scale, YY,
                                     toward=W0, pull=m.anchor * scale)
    return stats, [(r, max(e / norm, 0.0)) for r, e in zip(points, errors)]


def curve_points(n: int, points: int = 16) -> list[int]:
    """Where an error curve is measured: ``points`` evenly spaced numbers of removed channels, 0 to ``n − 1``."""
    return sorted({round(k * (n - 1) / (points - 1)) for k in range(points)})
