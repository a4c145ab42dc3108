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
updates with these two stages; the defaults are the paper's.

Everything works from Gram matrices; a bias on the output projection (OPT fc2) is one more column
of W against a constant row of ones in Z (``Z̃``), never penalised and never pruned.

Where this file departs from the paper (scale-free ρ, δ and Adam rate, damping in every solve, the best round
kept, 10 rounds, cheap rounds on token samples with bf16 products, the tie and threshold rules of the mask), a
hyperparameter restores the paper's choice where one exists; why each was made (docs/method.md: Deviations from
the paper).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from spap_lib.checks import hp
from spap_lib.errors import ParameterError
from spap_lib.methods.base import LayerProblem, Method, PruneResult, highest, register
from spap_lib.methods.cost_model import Shapes
from spap_lib.methods.parts.allocation import ALLOCATIONS
from spap_lib.methods.parts.selection import SELECTIONS, UPDATES, column_scores
from spap_lib.methods.spap.alternating import Rounds
from spap_lib.methods.spap.cost import layer_cost, token_samples
from spap_lib.methods.spap.curves import error_curve
from spap_lib.methods.spap.penalty import Penalty, penalty_method, with_bias
from spap_lib.model.adapters import MLP
from spap_lib.numerics.collective import total
from spap_lib.numerics.linalg import (
    PRECISION_CHOICES,
    mean_diag,
)
from spap_lib.numerics.solve import lstsq_columns, reconstruction_error
from spap_lib.numerics.stats import ChannelStats


@dataclass
class PenaltySettings:
    """Alg. 1's settings (``penalty.Penalty``): what a composition that selects with the penalty method carries."""

    # Defaults chosen on SmolLM2-135M by held-out MLP reconstruction error (docs/parameters.md: SPAP
    # hyperparameters, how each was chosen). The penalty-loop settings barely moved it; lr and rounds did.
    t: float = hp(0.5, ge=0, le=1)  # score mix t‖W_j‖² + (1−t)‖W_j‖₁‖Z_j‖₂ (docs/parameters.md)
    # the score's two terms as they are ("none", the paper) or each divided by its mean over the layer ("layer")
    score_scale: str = hp("none", choices=("none", "layer"))
    alpha: float = hp(0.5, ge=0, lt=1)  # soft mask update s ← αs + (1−α)s_new (α = 1 would never move s)
    rho0: float = hp(1e-2, gt=0)  # initial penalty, in units of mean(diag(Z Zᵀ))
    tau: float = hp(1.5, ge=1)  # penalty growth ρ ← τρ
    K: int = hp(20, ge=1)  # penalty iterations; ρ grows by τᴷ (docs/parameters.md: how each was chosen)
    # End the loop once s_new has marked the same channels at this many consecutive s-steps (0: all K, the paper).
    # 3 kept every measured layer's channels in fewer solves (docs/method/update-cost.md: patience)
    patience: int = hp(0, ge=0)
    # s-step rule: "top" = the λ lowest scores; "previous" = Alg. 1 as printed (below Top_{n−λ} of the
    # previous iteration's scores)
    threshold: str = hp("top", choices=("top", "previous"))

    def penalty(self, dense: MLP, H: torch.Tensor, n_remove: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Alg. 1 with these settings on the dense MLP's Gram matrix ``H`` (``penalty_method``)."""
        settings = Penalty(rho0=self.rho0, tau=self.tau, t=self.t, alpha=self.alpha, K=self.K, damp=self.damp,
                           threshold=self.threshold, scale_free=self.score_scale == "layer", patience=self.patience)
        return penalty_method(dense.out_augmented(), H, n_remove, settings, bias=dense.b_out is not None)


@dataclass
class RoundSettings:
    """§3.3's round settings (``alternating.Rounds``): what a composition whose update runs rounds carries."""

    am_iters: int = hp(10, ge=0)  # alternating-minimisation rounds (paper: 20; why 10: docs/parameters.md)
    adam_steps: int = hp(10, ge=1)  # Adam steps on the input projections per round
    # Adam step in units of each tensor's RMS: best on Qwen2.5-Coder-0.5B at 128 x 512 and on SmolLM2 at 32 x 512;
    # SmolLM2 at 128 x 512 prefers 1e-2, which configs/offline.yaml sets (docs/parameters.md: lr)
    lr: float = hp(5e-3, gt=0)
    lr_scale: str = hp("rms", choices=("rms", "absolute"))  # "absolute": lr is the plain Adam rate
    batch_tokens: int = hp(2048, ge=1)  # tokens per Adam step
    # Cheap update rounds (docs/method/update-cost.md: Cost of the update): each round's closed form and error on a
    # fixed sample of this many tokens (0: all), the best round refitted once on every token at ``precision``
    sketch_tokens: int = hp(16384, ge=0)
    # the rounds' products (Adam steps, the sampled Gram passes): "bf16" inputs with float32 sums, or "full"
    # (``precision``'s); sketch_tokens=0 with "full" is the paper's update
    update_precision: str = hp("bf16", choices=("bf16", "full"))
    # a fresh token sample for each round's closed form, the rounds ranked by a forward pass on the first
    # sample: one fixed sample let the rounds overfit it (docs/method/update-cost.md: Cost of the update)
    sketch_resample: bool = True
    # tokens of that first sample, which ranks the resampled rounds (0: ``sketch_tokens``): a ranking needs fewer
    # tokens than a fit (docs/method/update-cost.md: the per-layer cost)
    rank_tokens: int = hp(0, ge=0)
    # the products of that final refit on every token: "full" (``precision``'s) or "bf16" (``Z`` and ``Y Zᵀ`` from
    # bf16 inputs, ``Z Zᵀ`` a float32 product of the rounded ``Z``, as in the rounds); not a default: it priced
    # a layer whose output energy sits in a few tokens wrongly (docs/method/update-cost.md: the final refit in bf16)
    refit_precision: str = hp("full", choices=("full", "bf16"))

    def rounds(self, problem: LayerProblem) -> Rounds:
        """§3.3's round settings for this layer (its own seed), from the method's fields."""
        return Rounds(iters=self.am_iters, adam_steps=self.adam_steps, lr=self.lr, batch_tokens=self.batch_tokens,
                      damp=self.damp, chunk=problem.chunk, seed=problem.seed + problem.layer_index,
                      lr_scale=self.lr_scale, sketch_tokens=self.sketch_tokens, bf16=self.update_precision == "bf16",
                      resample=self.sketch_resample, rank_tokens=self.rank_tokens,
                      refit_bf16=self.refit_precision == "bf16")


# what only the penalty method reads (``t`` also ranks channels for a non-uniform allocation), and what only
# the update's rounds read
PENALTY_HPARAMS = tuple(f.name for f in fields(PenaltySettings))
ROUND_HPARAMS = tuple(f.name for f in fields(RoundSettings) if f.name != "am_iters")


@dataclass
class Composition(Method):
    """A layer-wise composition of the three parts (``methods.parts``): a selection, an allocation and an update,
    with what every one of them reads (damping, the refit's anchor, the concentration guard, the precision and the
    allocation's settings). The presets add the settings of the parts they offer: ``PenaltySettings`` to select
    with the penalty method, ``RoundSettings`` for an update with rounds."""

    # The three parts (methods.parts): the presets below differ only in these defaults.
    select: str = hp("penalty", choices=SELECTIONS)
    update: str = hp("alternating", choices=UPDATES)
    damp: float = hp(1e-3, ge=0)  # δ = damp·mean(diag(Z Zᵀ)) in every solve (docs/parameters.md)
    # The least-squares refit of the kept columns drawn toward their dense weights, min ‖Y − W Z_K‖² + μ‖W − W₀_K‖²
    # with μ = anchor·mean(diag(Z Zᵀ)): 0 is the plain refit (the paper's), a large anchor keeps the dense weights
    # (update "none"); in between for a refit that overfits its calibration tokens. The update's rounds are plain.
    anchor: float = hp(0.0, ge=0)
    # A layer whose largest 1% of calibration tokens hold more than this share of the dense output energy ‖Y‖²
    # (``LayerProblem.concentration``) keeps the kept channels' dense weights: there every fit above serves those few
    # tokens (massive activations at the first positions) at the others' expense. 1 (the paper) fits every layer.
    concentrated: float = hp(1.0, gt=0, le=1)
    precision: str = hp("auto", choices=PRECISION_CHOICES)  # Gram sums, solves (auto: float32 on CPU, tf32 on CUDA)
    # Per-layer budgets (decided on dense statistics, then pruned in sequence): "uniform" keeps stock
    # checkpoints; "global" = one threshold over layer-standardised dense scores; "angular" = CFSP's rule;
    # "error" = the widths that minimise the layers' summed relative error (``error_curve``, ``allocation.by_error``)
    allocation: str = "uniform"
    allocations = ALLOCATIONS  # every registered allocation, a new one too
    error_tokens: int = hp(16384, ge=1)  # tokens of each layer's error curve ("error" allocation only)
    # The share of the calibration windows (the first ones: random draws) whose dense pass decides non-uniform
    # widths; 1: all of them. The pass is a forward through every dense layer, a sizeable share of a prune; a quarter
    # of the windows cut it but gave back most of what the widths gained (docs/results/one-part-at-a-time.md: What
    # deciding the widths costs)
    allocation_sample: float = hp(1.0, gt=0, le=1)
    # That pass's replay of the dense layers with bf16 products ("bf16", float32 sums and hidden states) or the
    # model's own ("full"). The replay is all of the angular widths' cost; in bf16 it ran faster on a CPU with bf16
    # units, and the widths moved by a few channels on SmolLM2 and Qwen2.5-Coder-0.5B (docs/method.md: The error
    # allocation)
    allocation_precision: str = hp("full", choices=("full", "bf16"))
    # how a curve weighs its tokens: "token" = each token's error relative to its own output energy, averaged;
    # "energy" = the layer's summed error over its summed output energy, which the few tokens with massive
    # outputs decide (docs/method.md: The error allocation);
    # "residual" (the default) = each token's error relative to the hidden state it is added to (the block's
    # output), averaged and not divided by the layer's own output energy: how far the layer's error moves the
    # residual stream (why it is the default: docs/method.md, The error allocation)
    error_weight: str = hp("residual", choices=("token", "energy", "residual"))
    # Options added with the earlier behaviour as their default: a result recorded before one existed ran it.
    introduced = ("select", "update", "score_scale", "allocation", "error_tokens", "anchor", "concentrated", "patience",
                  "rank_tokens", "refit_precision", "allocation_sample", "allocation_precision")

    def validate(self) -> None:
        super().validate()
        if self.select == "penalty" and not isinstance(self, PenaltySettings):
            raise ParameterError(f"method {self.name!r} does not carry the penalty method's settings: select one of "
                                 f"{', '.join(k for k in SELECTIONS if k != 'penalty')}, or use spap")
        if "rounds" in UPDATES[self.update].needs and not isinstance(self, RoundSettings):
            raise ParameterError(f"method {self.name!r} does not carry the update's round settings: update one of "
                                 f"{', '.join(k for k, u in UPDATES.items() if 'rounds' not in u.needs)}, or use "
                                 "spap (alternating) or spap_gd (gd)")

    @property
    def refits(self) -> bool:
        """The update refits the kept channels' output projection (its ``needs``: ``refit``)."""
        return "refit" in UPDATES[self.update].needs

    @property
    def rounds_update(self) -> bool:
        """The update runs rounds of Adam steps (its ``needs``: ``rounds``; the rounds' hyperparameters act)."""
        return "rounds" in UPDATES[self.update].needs

    @property
    def closed_form_rounds(self) -> bool:
        """Each round ends in a closed-form solve (its ``needs``: ``closed_form``; no closed form: ``gd``)."""
        return "closed_form" in UPDATES[self.update].needs

    @property
    def uses_targets(self) -> bool:
        """The update's Adam steps fit the dense outputs token by token."""
        return self.rounds_update and self.am_iters > 0

    def parts(self) -> dict[str, str]:
        return {"select": self.select, "allocation": self.allocation, "update": self.update}

    def allocation_scores(self, mlp: MLP, stats: ChannelStats) -> torch.Tensor:
        """The selection's score on dense statistics (the penalty method: its first s-step's)."""
        if self.select == "penalty":
            return column_scores(mlp.W_out.double(), stats.norm, self.t, self.score_scale == "layer")
        return SELECTIONS[self.select].score(mlp, stats)

    def effective_hparams(self) -> dict:
        """The settings of parts not chosen are inert: the penalty method's without it, the rounds' without
        rounds (``update`` none/ls or ``am_iters=0``), resampling without a token sample or without a
        closed form to resample for (``gd``), the error curve's without the error allocation, the damping
        when nothing is solved for."""
        inert = set() if self.select == "penalty" else set(PENALTY_HPARAMS)
        if not self.refits:
            inert |= {"anchor", "concentrated"}  # nothing is refitted
            if self.select != "penalty":
                inert.add("damp")  # nothing is solved for
        if not self.rounds_update:
            inert |= {"am_iters", *ROUND_HPARAMS}
        elif self.am_iters == 0:
            inert |= set(ROUND_HPARAMS)
        elif self.sketch_tokens == 0 or not self.closed_form_rounds:
            inert |= {"sketch_resample", "rank_tokens"}
        elif not self.sketch_resample:
            inert.add("rank_tokens")  # the fixed sample ranks the rounds it fits
        if not self.closed_form_rounds or (self.sketch_tokens == 0 and self.update_precision == "full"):
            inert.add("refit_precision")  # no closed-form refit after the rounds (gd), or exact rounds need none
        if "curves" not in ALLOCATIONS[self.allocation].needs:
            inert |= {"error_tokens", "error_weight"}
        if "dense_pass" not in ALLOCATIONS[self.allocation].needs:
            inert |= {"allocation_sample", "allocation_precision"}
        return {k: v for k, v in self.hparams().items() if k not in inert}

    def cost(self, s: Shapes) -> dict[str, dict[str, float]]:
        """The work of one layer's prune by stage (``cost.layer_cost``: Alg. 1, the refit and the rounds)."""
        return layer_cost(self, s)

    def token_samples(self, s: Shapes) -> float:
        """The rounds' samples of ``X`` and ``Y`` rows (``cost.token_samples``)."""
        return token_samples(self, s)

    def channel_stats(self, mlp: MLP, X: torch.Tensor, H: torch.Tensor, chunk: int) -> ChannelStats:
        """What the selection's score reads: ``‖Z_j‖`` from the Gram diagonal, or a pass over the tokens for a
        score that needs channel means (its ``needs``: ``channel_mean``)."""
        if "channel_mean" in SELECTIONS[self.select].needs:
            return ChannelStats.of(mlp, X, chunk)
        return ChannelStats.norms(torch.diagonal(H)[:mlp.width], total(X.shape[0]))  # every rank's tokens

    def choose(self, problem: LayerProblem) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
        """The selection: the kept channels (sorted), the penalty method's own refitted output projection (Alg. 1's
        last step; ``None`` for the other selections) and diagnostics."""
        dense, H, n = problem.dense, problem.H, problem.dense.width
        if self.select == "penalty":
            return self.penalty(dense, H, problem.n_remove)
        stats = self.channel_stats(dense, problem.X, H, problem.chunk)
        return highest(SELECTIONS[self.select].score(dense, stats), n - problem.n_remove), None, {}

    def refit(self, problem: LayerProblem, keep: torch.Tensor) -> torch.Tensor:
        """The output projection's kept columns (+ bias) by least squares on the dense Gram matrix, drawn toward the
        dense weights by ``anchor``."""
        H, n = problem.H, problem.dense.width
        W0 = problem.dense.out_augmented().to(H.dtype)
        scale = mean_diag(H[:n, :n])
        return lstsq_columns(W0 @ H, H, with_bias(keep, n, problem.has_bias), self.damp * scale, toward=W0,
                             pull=self.anchor * scale)

    def prune(self, problem: LayerProblem) -> PruneResult:
        keep, W_keep, info = self.choose(problem)
        mlp = problem.dense.select(keep)
        if not self.refits:
            return PruneResult(mlp=mlp, keep=keep, info=info)
        if self.concentrated < 1:
            info["concentration"] = problem.concentration
            if problem.concentration > self.concentrated:
                return PruneResult(mlp=mlp, keep=keep, info=info)
        if W_keep is None or self.anchor:  # the penalty method's refit is the plain one (``anchor`` 0)
            W_keep = self.refit(problem, keep)
        mlp.set_out_augmented(W_keep)
        if self.rounds_update and self.am_iters > 0:
            refitted = mlp
            mlp, errors = UPDATES[self.update].rounds(refitted, problem, self.rounds(problem),
                                                      lambda: self.start_error(problem, keep, refitted))
            info["rel_error_penalty"], info["rel_error_final"] = errors["start"], errors["final"]
        return PruneResult(mlp=mlp, keep=keep, info=info)

    @staticmethod
    def start_error(problem: LayerProblem, keep: torch.Tensor, mlp: MLP) -> float:
        """The relative calibration error of the pruned ``mlp`` (channels ``keep``, its output projection refitted)
        from the dense Gram matrix: its kept rows (+ the ones row), and ``Y Z̃ᵀ = W₀ H`` on them. ``Y Z̃ᵀ`` comes
        first, so that at most one gathered block sits beside ``H`` at a time."""
        cols = with_bias(keep, problem.dense.width, problem.has_bias)
        YZ = problem.dense.out_augmented().to(problem.dtype) @ problem.H[:, cols]
        H = problem.H[cols[:, None], cols]
        return reconstruction_error(mlp.out_augmented(), H, YZ, problem.YY) / problem.YY

    def error_curve(self, mlp: MLP, X: torch.Tensor, chunk: int, residual: torch.Tensor | None = None,
                    stats: ChannelStats | None = None) -> tuple[ChannelStats, list[tuple[int, float]]]:
        """The dense layer's channel statistics and its error curve, for ``allocation="error"`` (``curves``)."""
        return error_curve(self, mlp, X, chunk, residual, stats)




@register
@dataclass
class SPAP(RoundSettings, PenaltySettings, Composition):
    """Penalty method (Alg. 1) for the mask, then alternating minimisation for the weights (§3.3); with ``select``,
    ``allocation`` and ``update`` any layer-wise composition of the three parts (``methods.parts``)."""

    name = "spap"
    ours = True


@register
@dataclass
class SPAPNoUpdate(PenaltySettings, Composition):
    """Ablation "SPAP w/o update" (paper Table 5): the penalty method (Alg. 1) and its least-squares
    refit of the kept columns, without the alternating minimisation of §3.3."""

    name = "spap_no_update"
    ours = True
    ablation_of = "spap"
    update: str = hp("ls", choices=UPDATES)


@register
@dataclass
class SPAPGD(SPAP):
    """Ablation "SPAP w. GD" (paper Table 5): the penalty method, then plain gradient descent (Adam) on
    all three projections instead of alternating minimisation, with the same budget as SPAP:
    ``am_iters × adam_steps`` Adam steps, the same learning rate and batch, the best checkpoint kept."""

    name = "spap_gd"
    ablation_of = "spap"
    update: str = hp("gd", choices=UPDATES)

