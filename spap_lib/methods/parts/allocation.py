"""How many MLP channels each layer loses, given one total budget.

The total is fixed by the sparsity plan (``layers · n_remove`` channels), so every allocation
removes exactly the same number of parameters; only its spread over layers differs.
* ``uniform``: the same count everywhere (stock-loadable checkpoints);
* ``global``: FLAP's adaptive structure (An et al., AAAI 2024): standardise each layer's scores to
  zero mean and unit variance, then remove the globally lowest;
* ``angular``: CFSP's coarse step (Wang et al., 2024): layers whose block turns the hidden state
  less (smaller angular distance) keep fewer channels;
* ``error``: each layer's measured relative reconstruction error at a few widths (``SPAP.error_curve``),
  and the removals that minimise their sum.
Every layer keeps at least one channel. ``rounded`` then makes every kept width a multiple of ``round_to``
(GEMM-friendly shapes) without changing the total.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from spap_lib.methods.parts.registry import Part, Registry


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


def rounded(counts: list[int], width: int, round_to: int) -> list[int]:
    """Per-layer removal counts whose kept widths ``width − count`` are multiples of ``round_to``, at least one
    multiple and at most the largest one ``≤ width``, with the same total. Each layer's kept width, in units
    of ``round_to``, is rounded to the nearest unit in range; then the layers furthest off move one unit at a
    time until the total is met. The total kept must itself be a multiple (the plan rounds the mean width)."""
    target = [(width - c) / round_to for c in counts]
    units, most = round(sum(target)), width // round_to
    if sum(width - c for c in counts) % round_to or not len(counts) <= units <= most * len(counts):
        raise ValueError(f"{sum(width - c for c in counts)} kept channels over {len(counts)} layers of width {width} "
                         f"cannot be split into multiples of {round_to} (between {round_to} and "
                         f"{most * round_to} per layer)")
    got = [min(max(round(t), 1), most) for t in target]
    while sum(got) > units:  # the one most above its target gives a unit back
        i = max((i for i in range(len(got)) if got[i] > 1), key=lambda i: got[i] - target[i])
        got[i] -= 1
    while sum(got) < units:  # the one most below its target takes a unit
        i = min((i for i in range(len(got)) if got[i] < most), key=lambda i: got[i] - target[i])
        got[i] += 1
    return [width - u * round_to for u in got]


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


def _lower_hull(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    """The lower convex hull of ``(r, e)`` points sorted by ``r`` (Andrew's monotone chain, lower half)."""
    hull: list[tuple[int, float]] = []
    for p in points:
        while len(hull) >= 2 and (hull[-1][1] - hull[-2][1]) * (p[0] - hull[-2][0]) >= \
                (p[1] - hull[-2][1]) * (hull[-1][0] - hull[-2][0]):
            hull.pop()
        hull.append(p)
    return hull


def by_error(curves: list[list[tuple[int, float]]], total: int) -> list[int]:
    """Removal counts summing to ``total`` that minimise the layers' summed error, each layer's error taken
    as linear between its measured points ``(r, e)`` (``r`` channels removed, ``r`` from 0 to at most the
    width − 1) and convexified. On convex curves removing channels where the next one costs least is
    optimal: the hull's segments are taken in order of slope, the last one in part."""
    segments = []  # (error per channel removed, layer, r at the segment's start, its length)
    for i, curve in enumerate(curves):
        if not all(math.isfinite(e) for _, e in curve):
            raise ValueError(f"layer {i}'s error curve is not finite: {curve}")
        lowest: dict[int, float] = {}
        for r, e in curve:  # one point per r: the lowest error measured there
            lowest[r] = min(e, lowest.get(r, e))
        hull = _lower_hull(sorted(lowest.items()))
        if hull[0][0] != 0:
            raise ValueError(f"layer {i}'s error curve does not start at 0 channels removed")
        segments += [((e1 - e0) / (r1 - r0), i, r0, r1 - r0) for (r0, e0), (r1, e1) in zip(hull, hull[1:])]
    counts, left = [0] * len(curves), total
    for _, i, _, length in sorted(segments):  # a layer's slopes rise along its hull: its segments stay in order
        take = min(length, left)
        counts[i] += take
        left -= take
        if not left:
            break
    if left:
        raise ValueError(f"cannot remove {total} channels: the curves reach {total - left}")
    return counts


@dataclass(frozen=True)
class Allocation(Part):
    """How the channel budget is spread over layers: ``split(method, stats, width, total, scores)`` gives each
    layer's removals, summing to ``total``, from the dense pass's statistics (``stats``, one ``ChannelStats`` per
    layer) and, where the entry needs them, every layer's ``scores``. Its ``needs`` say what that pass must
    measure: ``channel_stats`` (every token's ``Z`` at the dense width) or only each block's angular distance,
    which the replay gives (the angular allocation: its dense pass is the replay alone)."""

    split: Callable[..., list[int]] = lambda method, stats, width, total, scores: [total // len(stats)] * len(stats)


ALLOCATIONS = Registry("allocation")
ALLOCATIONS.register(Allocation("uniform"))
ALLOCATIONS.register(Allocation("global", frozenset({"dense_pass", "channel_stats", "scores"}),
                                split=lambda method, stats, width, total, scores: global_standardized(scores, total)))
# CFSP's angular rule, with CFSP's hyperparameters where the method has them (``scores.CFSP``), else their defaults
ANGULAR = {"a": 1.0, "scale": 1e4}
ALLOCATIONS.register(Allocation("angular", frozenset({"dense_pass"}), split=lambda method, stats, width, total, scores:
                                angular([s.angular for s in stats], width, total,
                                        **{k: getattr(method, k, v) for k, v in ANGULAR.items()})))
ALLOCATIONS.register(Allocation("error", frozenset({"dense_pass", "channel_stats", "curves"}),
                                split=lambda method, stats, width, total, scores: by_error([s.curve for s in stats],
                                                                                           total)))
