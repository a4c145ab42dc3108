"""Two of the three parts every layer-wise prune composes: which channels a layer keeps (the *selection*) and
what happens to the kept weights (the *update*); how many each layer keeps (the *allocation*) is
``allocation``'s. Each is a ``Registry`` of entries that declare their ``needs``.

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

from dataclasses import dataclass
from typing import Callable

import torch

from spap_lib.methods.parts.registry import Part, Registry
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


@dataclass(frozen=True)
class Selection(Part):
    """Which channels a layer keeps. ``score(method, mlp, stats)`` ranks them on the layer's channel statistics
    (higher = more important; ``stats.norm`` may come from a Gram diagonal). ``choose(method, problem)``, where
    given, replaces keeping the highest scores: the penalty method's score moves with its W-steps, and it returns
    its own refitted output projection (``Composition.choose``)."""

    score: Callable[..., torch.Tensor] | None = None
    choose: Callable | None = None


def _fixed(score: Callable[[MLP, ChannelStats], torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A score that no hyperparameter of the method changes."""
    return lambda method, mlp, stats: score(mlp, stats)


# the penalty method registers beside its maths: ``methods/spap/penalty.py``
SELECTIONS = Registry("selection")
SELECTIONS.register(Selection("wanda", score=_fixed(lambda mlp, s: mlp.W_out.double().abs().sum(0) * s.norm)))
SELECTIONS.register(Selection("act_norm", score=_fixed(lambda mlp, s: s.norm.double())))
SELECTIONS.register(Selection("fluctuation", frozenset({"channel_mean"}),
                              score=_fixed(lambda mlp, s: s.var * mlp.W_out.double().pow(2).sum(0))))
SELECTIONS.register(Selection("magnitude", score=_fixed(lambda mlp, s: mlp.W_out.double().norm(dim=0))))


@dataclass(frozen=True)
class Update(Part):
    """What happens to the kept weights; its ``needs`` say whether it refits and whether it runs rounds. An update
    with rounds runs them in ``rounds(mlp, problem, settings, start_error) -> (mlp, errors)``: the refitted
    ``mlp``, the layer's ``LayerProblem``, the round settings (``spap.alternating.Rounds``) and a callable giving
    the refitted layer's error from the dense Gram matrix, before the rounds release it."""
    rounds: Callable | None = None


UPDATES = Registry("update")
UPDATES.register(Update("none"))
UPDATES.register(Update("ls", frozenset({"refit"})))
# the updates with rounds register beside their maths: ``methods/spap/alternating.py``
