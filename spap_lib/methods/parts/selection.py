"""The three parts every layer-wise prune composes: which channels a layer keeps (the *selection*), how
many each layer keeps (the *allocation*, ``Method.removals``) and what happens to the kept weights (the
*update*).

A layer-wise method (``spap.SPAP`` and its presets) names one of each, as hyperparameters: ``spap`` is
``select=penalty, allocation=uniform, update=alternating``, ``fasp`` is ``select=wanda, update=ls``, and
any other composition is one label, e.g. ``spap/select=act_norm,allocation=error``.

Selections (higher score = more important; channel j is column j of the output projection ``W [d, n]``
and ``Z_j`` its input over the calibration tokens):

* ``penalty``: the penalty method (paper Alg. 1), whose score ``column_scores`` moves with its W-steps;
* ``wanda``: ``Σ_i |W_ij|·‖Z_j‖`` (FASP's metric, Wanda-SP's);
* ``act_norm``: ``‖Z_j‖`` (the ranking CFSP's score reduces to within a layer);
* ``fluctuation``: ``Var_t(Z_tj)·‖W[:, j]‖²`` (FLAP's);
* ``magnitude``: ``‖W[:, j]‖₂``.

Updates: ``none`` (the kept channels' dense weights), ``ls`` (the output projection refitted by least
squares on the kept channels; with ``anchor`` > 0 drawn toward their dense weights, between ``none`` and
``ls``), ``alternating`` (``ls``, then the paper's alternating minimisation, §3.3), ``gd`` (``ls``, then Adam
on every projection: the paper's "SPAP w. GD" ablation). With ``concentrated`` < 1 a layer whose output energy
sits in a few tokens (massive activations) keeps the dense weights of its kept channels whatever the update.
"""
from __future__ import annotations

from typing import Callable

import torch

from spap_lib.model.adapters import MLP
from spap_lib.numerics.stats import ChannelStats


def column_scores(W: torch.Tensor, znorm: torch.Tensor, t: float, scale_free: bool = False) -> torch.Tensor:
    """The penalty method's s-step score ``t‖W[:,j]‖² + (1−t)‖W[:,j]‖₁‖Zⱼ‖₂`` for every column j (higher = more
    important). ``scale_free`` divides each term by its mean over the layer's columns first: the two terms
    are in different units (the first has none of the activations' scale), so without it the second
    decides alone wherever weights are small (docs/method.md: Deviations from the paper)."""
    sq, l1 = W.pow(2).sum(0), W.abs().sum(0) * znorm
    if scale_free:
        sq, l1 = sq / sq.mean().clamp_min(1e-30), l1 / l1.mean().clamp_min(1e-30)
    return t * sq + (1 - t) * l1


# The score selections, on a layer's channel statistics (``stats.norm`` may be taken from a Gram diagonal).
SCORES: dict[str, Callable[[MLP, ChannelStats], torch.Tensor]] = {
    "wanda": lambda mlp, s: mlp.W_out.double().abs().sum(0) * s.norm,
    "act_norm": lambda mlp, s: s.norm.double(),
    "fluctuation": lambda mlp, s: s.var * mlp.W_out.double().pow(2).sum(0),
    "magnitude": lambda mlp, s: mlp.W_out.double().norm(dim=0),
}
NEEDS_MEAN = ("fluctuation",)  # scores that need each channel's mean over tokens (not in a Gram diagonal)
SELECTIONS = ("penalty", *SCORES)
UPDATES = ("none", "ls", "alternating", "gd")
ROUNDS = ("alternating", "gd")  # the updates with rounds of Adam steps (and their hyperparameters)
