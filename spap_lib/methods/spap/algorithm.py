"""SPAP (Hu & Yuan, 2025, arXiv:2505.03373), §3.

One name per symbol, as in the paper: ``X`` the MLP inputs ``[N, d]`` (after the layer's norm),
``Z = σ(W_gate X) ⊙ W_up X`` (``act(W_fc1 X)`` for OPT) the output projection's inputs ``[n, N]``,
``W`` the output projection ``[d, n]``, ``Y = W₀ Z₀`` the dense outputs, ``H = Z Zᵀ`` the Gram
matrix, ``s ∈ {0,1}ⁿ`` marking the ``λ`` channels to *remove*:

    min_{W,s} ½‖W Z − Y‖²   s.t.  W diag(s) = 0,  1ᵀs = λ.

1. ``penalty.penalty_method`` (Alg. 1): relax s to [0,1]ⁿ and penalise ``ρ Σⱼ sⱼ‖W[:,j]‖²``; alternate
   the s-step (the λ lowest scores ``t‖W[:,j]‖² + (1−t)‖W[:,j]‖₁‖Zⱼ‖₂``, softened by
   ``s ← αs + (1−α)s_new``) and the closed-form W-step ``W = Y Zᵀ(Z Zᵀ + ρ diag(s) + δI)⁻¹``;
   grow ``ρ ← τρ``. Then a hard mask and a least-squares refit of the kept columns.
2. ``alternating.alternating_update`` (§3.3): the MLP splits into input projections (gate/up or fc1) and the
   output projection ``W``. Each round: Adam steps on the former with ``W`` fixed, then the closed
   form ``W = Y Zᵀ(Z Zᵀ + δI)⁻¹`` on the new ``Z``; the best round is kept.

``select``, ``allocation`` and ``update`` (``methods.parts``) compose other channel choices, per-layer widths and
updates with these two stages; the defaults are the paper's. This file holds the presets: the composition itself is
``parts/composition.py``, Alg. 1 and its settings ``penalty.py``, the rounds and theirs ``alternating.py``.

Everything works from Gram matrices; a bias on the output projection (OPT fc2) is one more column
of W against a constant row of ones in Z (``Z̃``), never penalised and never pruned.

Where this file departs from the paper (scale-free ρ, δ and Adam rate, damping in every solve, the best round
kept, 10 rounds, cheap rounds on token samples with bf16 products, the tie and threshold rules of the mask), a
hyperparameter restores the paper's choice where one exists; why each was made (docs/method.md: Deviations from
the paper).
"""
from __future__ import annotations

from dataclasses import dataclass

from spap_lib.checks import hp
from spap_lib.methods.base import register
from spap_lib.methods.parts.composition import Composition
from spap_lib.methods.parts.selection import UPDATES
from spap_lib.methods.spap.alternating import RoundSettings
from spap_lib.methods.spap.penalty import PenaltySettings


@register
@dataclass
class SPAP(RoundSettings, PenaltySettings, Composition):
    """Penalty method (Alg. 1) for the mask, then alternating minimisation for the weights (§3.3); with ``select``,
    ``allocation`` and ``update`` any layer-wise composition of the three parts (``methods.parts``)."""

    name = "spap"


@register
@dataclass
class SPAPNoUpdate(PenaltySettings, Composition):
    """Ablation "SPAP w/o update" (paper Table 5): the penalty method (Alg. 1) and its least-squares
    refit of the kept columns, without the alternating minimisation of §3.3."""

    name = "spap_no_update"
    update: str = hp("ls", choices=UPDATES)


@register
@dataclass
class SPAPGD(SPAP):
    """Ablation "SPAP w. GD" (paper Table 5): the penalty method, then plain gradient descent (Adam) on
    all three projections instead of alternating minimisation, with the same budget as SPAP:
    ``am_iters × adam_steps`` Adam steps, the same learning rate and batch, the best checkpoint kept."""

    name = "spap_gd"
    update: str = hp("gd", choices=UPDATES)

