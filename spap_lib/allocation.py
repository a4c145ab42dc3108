"""How many MLP channels each layer loses, given one total budget.

The total is fixed by the sparsity plan (``layers · n_remove`` channels), so every allocation
removes exactly the same number of parameters; only its spread over layers differs.
* ``uniform``: the same count everywhere (stock-loadable checkpoints);
* ``global``: FLAP's adaptive structure (An et al., AAAI 2024): standardise each layer's scores to
  zero mean and unit variance, then remove the globally lowest;
* ``angular``: CFSP's coarse step (Wang et al., 2024): layers whose block turns the hidden state
  less (smaller angular distance) keep fewer channels.
Every layer keeps at least one channel.
"""
from __future__ import annotations

import math

import torch


def _largest_remainder(quota: list[float], total: int, cap: list[int]) -> list[int]:
    """Integers ``≤ cap`` summing to ``total`` that round ``quota`` (Hamilton's method)."""
    counts = [min(int(math.floor(q)), c) for q, c in zip(quota, cap)]
    order = sorted(range(len(quota)), key=lambda i: quota[i] - math.floor(quota[i]), reverse=True)
    while sum(counts) < total:
        progressed = False
        for i in order:
            if sum(counts) == total:
                break
            if counts[i] < cap[i]:
                counts[i] += 1
                progressed = True
        if not progressed:
            raise ValueError(f"cannot place {total} removals under the caps {cap}")
    return counts


def global_standardized(scores: list[torch.Tensor], total: int) -> list[int]:
    """Per-layer removal counts from one threshold over layer-standardised scores (FLAP)."""
    z = [(s.double() - s.double().mean()) / s.double().std().clamp_min(1e-12) for s in scores]
    # Each layer's best channel is never removed, so every layer keeps one.
    for zi in z:
        zi[torch.argmax(zi)] = math.inf
    flat = torch.cat(z)
    layer_of = torch.cat([torch.full((len(zi),), i, device=flat.device) for i, zi in enumerate(z)])
    lowest = torch.topk(flat, total, largest=False).indices
    return torch.bincount(layer_of[lowest], minlength=len(scores)).tolist()


def angular(importance: list[float], width: int, total: int, *, a: float = 1.0, scale: float = 1e4) -> list[int]:
    """CFSP's allocation: ``keep_i ∝ sigmoid(a·(I_i − mean I)/scale)``, rescaled so no layer keeps
    more than it has; ``I_i`` is the token-summed angular distance of block i (as CFSP's code does,
    so ``scale`` is in token-sum units: CFSP uses 1e4)."""
    L = len(importance)
    keep_ratio = 1 - total / (L * width)
    mid = sum(importance) / L
    sig = [1 / (1 + math.exp(-a * (x - mid) / scale)) for x in importance]
    avg = sum(sig) / L
    top = max(sig)
    if top / avg * keep_ratio >= 1:  # shrink the spread until the most important layer fits
        shrink = (avg * (1 / keep_ratio - 1)) / (top - avg) / 1.05
        sig = [avg + (s - avg) * shrink for s in sig]
        avg = sum(sig) / L
    keep = [s / avg * keep_ratio * width for s in sig]
    removed = [width - k for k in keep]
    return _largest_remainder(removed, total, [width - 1] * L)
