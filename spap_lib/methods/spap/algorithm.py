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

from dataclasses import dataclass

import torch

from spap_lib.checks import hp
from spap_lib.methods.base import LayerProblem, Method, PruneResult, Shapes, chunks_of, highest, register, solve_flops
from spap_lib.methods.parts.selection import NEEDS_MEAN, ROUNDS, SCORES, SELECTIONS, UPDATES, column_scores
from spap_lib.methods.spap.alternating import Rounds, alternating_update, gradient_update, subsample
from spap_lib.methods.spap.penalty import penalty_method, with_bias
from spap_lib.model.adapters import MLP
from spap_lib.numerics.linalg import (
    PRECISION_CHOICES,
    PRECISIONS,
    check_finite,
    gram,
    gram_flops,
    matmul_precision,
    mean_diag,
    resolve_precision,
)
from spap_lib.numerics.solve import lstsq_columns, nested_lstsq_errors, reconstruction_error
from spap_lib.numerics.stats import ChannelStats

# what only the penalty method reads (``t`` also ranks channels for a non-uniform allocation), and what only
# the update's rounds read
PENALTY_HPARAMS = ("t", "alpha", "rho0", "tau", "K", "threshold", "score_scale", "patience")
ROUND_HPARAMS = ("adam_steps", "lr", "lr_scale", "batch_tokens", "sketch_tokens", "update_precision", "sketch_resample",
                 "rank_tokens", "refit_precision")


@register
@dataclass
class SPAP(Method):
    """Penalty method (Alg. 1) for the mask, then alternating minimisation for the weights; with ``select``,
    ``allocation`` and ``update`` any layer-wise composition of the three parts (``methods.parts``)."""

    name = "spap"
    ours = True
    # The three parts (methods.parts): the presets below differ only in these defaults.
    select: str = hp("penalty", choices=SELECTIONS)
    update: str = hp("alternating", choices=UPDATES)
    # Defaults chosen on SmolLM2-135M by held-out MLP reconstruction error (docs/parameters.md: SPAP
    # hyperparameters, how each was chosen). The penalty-loop settings barely moved it; lr and rounds did.
    t: float = hp(0.5, ge=0, le=1)  # score mix t‖W_j‖² + (1−t)‖W_j‖₁‖Z_j‖₂ (t=1, weights only, is worse)
    # the score's two terms as they are ("none", the paper) or each divided by its mean over the layer ("layer")
    score_scale: str = hp("none", choices=("none", "layer"))
    alpha: float = hp(0.5, ge=0, lt=1)  # soft mask update s ← αs + (1−α)s_new (α = 1 would never move s)
    rho0: float = hp(1e-2, gt=0)  # initial penalty, in units of mean(diag(Z Zᵀ))
    tau: float = hp(1.5, ge=1)  # penalty growth ρ ← τρ
    K: int = hp(20, ge=1)  # penalty iterations (10 and 30 gave the same masks; ρ grows by τᴷ)
    # End the loop once s_new has marked the same channels at this many consecutive s-steps (0: all K, the paper).
    # 3 kept every measured layer's channels in fewer solves (docs/method/update-cost.md: patience)
    patience: int = hp(0, ge=0)
    # s-step rule: "top" = the λ lowest scores; "previous" = Alg. 1 as printed (below Top_{n−λ} of the
    # previous iteration's scores)
    threshold: str = hp("top", choices=("top", "previous"))
    damp: float = hp(1e-3, ge=0)  # δ = damp·mean(diag(Z Zᵀ)) in every solve (1e-4 and 1e-2 were worse)
    # The least-squares refit of the kept columns drawn toward their dense weights, min ‖Y − W Z_K‖² + μ‖W − W₀_K‖²
    # with μ = anchor·mean(diag(Z Zᵀ)): 0 is the plain refit (the paper's), a large anchor keeps the dense weights
    # (update "none"); in between for a refit that overfits its calibration tokens. The update's rounds are plain.
    anchor: float = hp(0.0, ge=0)
    # A layer whose largest 1% of calibration tokens hold more than this share of the dense output energy ‖Y‖²
    # (``LayerProblem.concentration``) keeps the kept channels' dense weights: there every fit above serves those few
    # tokens (massive activations at the first positions) at the others' expense. 1 (the paper) fits every layer.
    concentrated: float = hp(1.0, gt=0, le=1)
    am_iters: int = hp(10, ge=0)  # alternating-minimisation rounds (paper: 20; on 16k tokens 20 overfits, 10 was best)
    adam_steps: int = hp(10, ge=1)  # Adam steps on the input projections per round
    # Adam step in units of each tensor's RMS: best on Qwen2.5-Coder-0.5B at 128 x 512 and on SmolLM2 at 32 x 512;
    # SmolLM2 at 128 x 512 prefers 1e-2, which configs/offline.yaml sets (docs/parameters.md: lr)
    lr: float = hp(5e-3, gt=0)
    lr_scale: str = hp("rms", choices=("rms", "absolute"))  # "absolute": lr is the plain Adam rate
    batch_tokens: int = hp(2048, ge=1)  # tokens per Adam step
    precision: str = hp("auto", choices=PRECISION_CHOICES)  # Gram sums, solves (auto: float32 on CPU, tf32 on CUDA)
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
    # tokens than a fit; 4,096 kept the held-out error at a quarter of the ranking's passes
    # (docs/method/update-cost.md: the per-layer cost)
    rank_tokens: int = hp(0, ge=0)
    # the products of that final refit on every token: "full" (``precision``'s) or "bf16" (``Z`` and ``Y Zᵀ`` from
    # bf16 inputs, ``Z Zᵀ`` a float32 product of the rounded ``Z``, as in the rounds); not a default: it priced
    # a layer whose output energy sits in a few tokens wrongly (docs/method/update-cost.md: the final refit in bf16)
    refit_precision: str = hp("full", choices=("full", "bf16"))
    # Per-layer budgets (decided on dense statistics, then pruned in sequence): "uniform" keeps stock
    # checkpoints; "global" = one threshold over layer-standardised dense scores; "angular" = CFSP's rule;
    # "error" = the widths that minimise the layers' summed relative error (``error_curve``, ``allocation.by_error``)
    allocation: str = "uniform"
    allocations = ("uniform", "global", "angular", "error")
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
    # outputs decide: it stayed flat in SmolLM2's concentrated layers 2, 11 and 28, and the allocation left them
    # almost no channels (docs/method.md: The error allocation);
    # "residual" (the default) = each token's error relative to the hidden state it is added to (the block's
    # output), averaged and not divided by the layer's own output energy: how far the layer's error moves the
    # residual stream; better than "token" on SmolLM2 at every sparsity measured (docs/method.md: The error
    # allocation)
    error_weight: str = hp("residual", choices=("token", "energy", "residual"))
    # Options added with the earlier behaviour as their default: a result recorded before one existed ran it.
    introduced = ("select", "update", "score_scale", "allocation", "error_tokens", "anchor", "concentrated", "patience",
                  "rank_tokens", "refit_precision", "allocation_sample", "allocation_precision")

    @property
    def uses_targets(self) -> bool:
        """The update's Adam steps fit the dense outputs token by token."""
        return self.update in ROUNDS and self.am_iters > 0

    def parts(self) -> dict[str, str]:
        return {"select": self.select, "allocation": self.allocation, "update": self.update}

    def allocation_scores(self, mlp: MLP, stats: ChannelStats) -> torch.Tensor:
        """The selection's score on dense statistics (the penalty method: its first s-step's)."""
        if self.select == "penalty":
            return column_scores(mlp.W_out.double(), stats.norm, self.t, self.score_scale == "layer")
        return SCORES[self.select](mlp, stats)

    def effective_hparams(self) -> dict:
        """The settings of parts not chosen are inert: the penalty method's without it, the rounds' without
        rounds (``update`` none/ls or ``am_iters=0``), resampling without a token sample or without a
        closed form to resample for (``gd``), the error curve's without the error allocation, the damping
        when nothing is solved for."""
        inert = set() if self.select == "penalty" else set(PENALTY_HPARAMS)
        if self.update == "none":
            inert |= {"anchor", "concentrated"}  # nothing is refitted
            if self.select != "penalty":
                inert.add("damp")  # nothing is solved for
        if self.update not in ROUNDS:
            inert |= {"am_iters", *ROUND_HPARAMS}
        elif self.am_iters == 0:
            inert |= set(ROUND_HPARAMS)
        elif self.sketch_tokens == 0 or self.update == "gd":
            inert |= {"sketch_resample", "rank_tokens"}
        elif not self.sketch_resample:
            inert.add("rank_tokens")  # the fixed sample ranks the rounds it fits
        if self.update == "gd" or (self.sketch_tokens == 0 and self.update_precision == "full"):
            inert.add("refit_precision")  # no closed-form refit after the rounds (gd), or exact rounds need none
        if self.allocation != "error":
            inert |= {"error_tokens", "error_weight"}
        if self.allocation == "uniform":
            inert |= {"allocation_sample", "allocation_precision"}
        return {k: v for k, v in self.hparams().items() if k not in inert}

    def cost(self, s: Shapes) -> dict[str, dict[str, float]]:
        """The dense Gram pass, the selection (K penalty solves and the refit, or one refit; a statistics pass
        for a score needing channel means), then (rounds) the update: Adam's forward and backward products,
        each round's pass over its token sample and its solve, and the final refit on every token when the
        rounds were cheap (a sample or bf16)."""
        stages = super().cost(s)
        one_refit = stages.pop("refit solve")
        if self.select == "penalty":  # with ``patience``, as where the first marked set stays (every layer measured)
            iters = min(self.K, self.patience + 1) if self.patience else self.K
            stages["penalty / refit solves"] = {"solve": (iters + 1) * solve_flops(s.n + 1, s.d), "steps": iters + 1}
        elif self.update != "none":
            stages["refit solve"] = one_refit
        if self.select in NEEDS_MEAN:
            stages["channel statistics"] = {"fp32": 2 * s.in_proj * s.N * s.d * s.n, "steps": chunks_of(s.N, s.chunk)}
        if self.concentrated < 1 and self.update != "none" and not self.uses_targets:  # ``concentration``'s forward
            stages["output energies"] = {"fp32": 2 * (s.in_proj + 1) * s.N * s.d * s.n,
                                         "steps": chunks_of(s.N, s.chunk)}
        if self.allocation == "error":  # each layer's curve: a Gram pass on its sample, then its points' errors
            Na = self.allocation_tokens(s.N)
            Ne, points = min(self.error_tokens, Na), curve_points(s.n)
            # reading every token of the pass, the curve's Gram pass takes the channel statistics ("dense channel
            # statistics" prices its forward); on a sample, a forward of its own
            forward = 2 * s.in_proj * Ne * s.d * s.n if Ne < Na else 0
            # each token's output energy; "residual" reads the block outputs' energies, N·d
            weigh = 2 * Ne * s.n * s.d if self.error_weight == "token" else 0
            kept = [s.n - r + 1 for r in points]
            # a float64 quadratic form per point (update none), or one float64 factorisation and forward solve of
            # the whole layer and a back-solve per point (``nested_lstsq_errors``); priced at the solves' rate
            solves = sum(2 * k * k * s.d for k in kept) if self.update == "none" else \
                (s.n + 1) ** 3 / 3 + (s.n + 1) ** 2 * s.d + sum(k * k * s.d for k in kept)
            stages["error curves"] = {"fp32": forward + gram_flops(Ne, s.n) + weigh,
                                      "solve": solves, "steps": chunks_of(Ne, s.chunk) + len(points) + 1}
        if self.update not in ROUNDS or not self.am_iters:
            return stages
        low = "bf16" if self.update_precision == "bf16" else "fp32"  # the rounds' products (``linalg.products``)
        Nr = min(self.sketch_tokens or s.N, s.N)  # the rounds' token sample
        refit = Nr < s.N or low == "bf16"  # the best round refitted on every token at ``precision``
        mlp = 2 * (s.in_proj + 1) * s.d * s.n_keep  # per token: the pruned MLP's forward
        steps = self.am_iters * self.adam_steps
        stages["Adam steps"] = {low: steps * min(self.batch_tokens, s.N) * 3 * mlp, "steps": steps}
        passes = self.am_iters * chunks_of(Nr, s.chunk) + (chunks_of(s.N, s.chunk) if refit else 0)
        if self.update == "gd":  # every round: a forward pass for the error on the rounds' sample
            rounds = {low: self.am_iters * Nr * mlp}
            rounds["fp32"] = rounds.get("fp32", 0) + (s.N * mlp if refit else 0)
            stages["alternating rounds (Gram / error)"] = rounds | {"steps": passes}
            return stages
        # alternating: ``Z`` and ``Y Zᵀ`` in the rounds' precision, ``Z Zᵀ`` in float32, and (resampled) the
        # ranking forward pass on the first sample; one solve per round and per refit
        z_yz = 2 * s.in_proj * s.d * s.n_keep + 2 * s.d * s.n_keep  # per token
        Nq = min(self.rank_tokens or Nr, s.N) if self.sketch_resample and Nr < s.N else 0  # the ranking sample
        rounds = {low: self.am_iters * (Nr * z_yz + Nq * mlp)}
        rounds["fp32"] = rounds.get("fp32", 0) + self.am_iters * gram_flops(Nr, s.n_keep)
        if refit:  # ``Z`` and ``Y Zᵀ`` at ``refit_precision``, ``Z Zᵀ`` in float32 either way
            final = "bf16" if self.refit_precision == "bf16" else "fp32"
            rounds[final] = rounds.get(final, 0) + s.N * z_yz
            rounds["fp32"] += gram_flops(s.N, s.n_keep)
        stages["alternating rounds (Gram / error)"] = rounds | {"steps": passes}
        stages["alternating rounds (solves)"] = {"solve": (self.am_iters + refit) * solve_flops(s.n_keep, s.d),
                                                 "steps": self.am_iters + refit}
        return stages

    def token_samples(self, s: Shapes) -> float:
        """The rounds' samples of ``X`` and ``Y`` rows (``subsample``; every token is no copy): one of
        ``sketch_tokens``, and resampled, the ranking sample of ``rank_tokens`` beside each round's fresh one."""
        if self.update not in ROUNDS or not self.am_iters or not 0 < self.sketch_tokens < s.N:
            return 0.0
        resampled = self.sketch_resample and self.update != "gd"
        ranking = min(self.rank_tokens or self.sketch_tokens, s.N) if resampled else 0
        tokens = self.sketch_tokens + (ranking if ranking < s.N else 0)
        return tokens * 2 * s.d * s.b

    def channel_stats(self, mlp: MLP, X: torch.Tensor, H: torch.Tensor, chunk: int) -> ChannelStats:
        """What the selection's score reads: ``‖Z_j‖`` from the Gram diagonal, or a pass over the tokens for a
        score that needs channel means (``parts.NEEDS_MEAN``)."""
        if self.select in NEEDS_MEAN:
            return ChannelStats.of(mlp, X, chunk)
        return ChannelStats.norms(torch.diagonal(H)[:mlp.width], X.shape[0])

    def choose(self, problem: LayerProblem) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
        """The selection: the kept channels (sorted), the penalty method's own refitted output projection (Alg. 1's
        last step; ``None`` for the other selections) and diagnostics."""
        dense, H, n = problem.dense, problem.H, problem.dense.width
        if self.select == "penalty":
            return self.penalty(dense, H, problem.n_remove)
        stats = self.channel_stats(dense, problem.X, H, problem.chunk)
        return highest(SCORES[self.select](dense, stats), n - problem.n_remove), None, {}

    def penalty(self, dense: MLP, H: torch.Tensor, n_remove: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Alg. 1 with this method's settings on the dense MLP's Gram matrix ``H`` (``penalty_method``)."""
        return penalty_method(dense.out_augmented(), H, n_remove, bias=dense.b_out is not None, rho0=self.rho0,
                              tau=self.tau, t=self.t, alpha=self.alpha, K=self.K, damp=self.damp,
                              threshold=self.threshold, scale_free=self.score_scale == "layer", patience=self.patience)

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
        if self.update == "none":
            return PruneResult(mlp=mlp, keep=keep, info=info)
        if self.concentrated < 1:
            info["concentration"] = problem.concentration
            if problem.concentration > self.concentrated:
                return PruneResult(mlp=mlp, keep=keep, info=info)
        if W_keep is None or self.anchor:  # the penalty method's refit is the plain one (``anchor`` 0)
            W_keep = self.refit(problem, keep)
        mlp.set_out_augmented(W_keep)
        if self.update in ROUNDS and self.am_iters > 0:
            if self.update == "gd":
                problem.release_gram()
                mlp, errors = gradient_update(mlp, problem.X, problem.Y, self.rounds(problem), YY=problem.YY)
            else:
                start_error = self.start_error(problem, keep, mlp)
                problem.release_gram()  # the rounds accumulate their own
                mlp, errors = alternating_update(mlp, problem.X, problem.Y, self.rounds(problem),
                                                 start_error=start_error, YY=problem.YY, dtype=problem.dtype)
            info["rel_error_penalty"], info["rel_error_final"] = errors["start"], errors["final"]
        return PruneResult(mlp=mlp, keep=keep, info=info)

    def rounds(self, problem: LayerProblem) -> Rounds:
        """§3.3's round settings for this layer (its own seed), from the method's fields."""
        return Rounds(iters=self.am_iters, adam_steps=self.adam_steps, lr=self.lr, batch_tokens=self.batch_tokens,
                      damp=self.damp, chunk=problem.chunk, seed=problem.seed + problem.layer_index,
                      lr_scale=self.lr_scale, sketch_tokens=self.sketch_tokens, bf16=self.update_precision == "bf16",
                      resample=self.sketch_resample, rank_tokens=self.rank_tokens,
                      refit_bf16=self.refit_precision == "bf16")

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
        precision = resolve_precision(self.precision, mlp.W_out.device)
        weight = self.error_weight
        if weight == "residual" and residual is None:
            raise ValueError("error_weight='residual' needs the energies of the hidden states the outputs are added to")
        Xe, reference = subsample(X, residual.to(X.device) if weight == "residual" else None, self.error_tokens, seed=0)
        if stats is None and Xe is not X:
            stats = ChannelStats.of(mlp, X, chunk)
        taken = ChannelStats.empty(mlp.width, mlp.W_out.device) if stats is None else None
        with matmul_precision(precision):
            H = gram(mlp, Xe, chunk, dtype=PRECISIONS[precision], per_token=weight == "token",
                     reference=reference, each=None if taken is None else taken.add)
        stats = taken if stats is None else stats
        check_finite(H, "the error curve's Gram matrix entries")
        n, bias = mlp.width, mlp.b_out is not None
        order = torch.argsort(self.allocation_scores(mlp, stats), descending=True).to(H.device)  # best first
        W0 = mlp.out_augmented().to(H.dtype)
        YZ = W0 @ H  # Y Z̃ᵀ with Y = W0 Z̃
        YY = max(float((YZ.double() * W0.double()).sum()), torch.finfo(torch.float64).tiny)  # ‖Y‖² = ⟨W0 H, W0⟩
        # "residual": the errors relative to the residual stream, averaged over the tokens, in the same units in
        # every layer; the others: relative to the layer's own (weighted) output energy
        norm = Xe.shape[0] if weight == "residual" else YY
        scale = mean_diag(H[:n, :n])
        points = curve_points(n)
        if self.update == "none":  # the dense weights of the kept columns
            errors = [reconstruction_error(W0[:, cols], H[cols][:, cols], YZ[:, cols], YY)
                      for cols in (with_bias(torch.sort(order[:n - r]).values, n, bias) for r in points)]
        else:  # the least-squares refit of every point from one factorisation (the kept sets are nested)
            nested = torch.cat([order.new_tensor([n]), order]) if bias else order  # the bias column is always kept
            errors = nested_lstsq_errors(YZ, H, nested, [n - r + bias for r in points], self.damp * scale, YY,
                                         toward=W0, pull=self.anchor * scale)
        return stats, [(r, max(e / norm, 0.0)) for r, e in zip(points, errors)]


def curve_points(n: int, points: int = 16) -> list[int]:
    """Where an error curve is measured: ``points`` evenly spaced numbers of removed channels, 0 to ``n − 1``."""
    return sorted({round(k * (n - 1) / (points - 1)) for k in range(points)})


@register
@dataclass
class SPAPNoUpdate(SPAP):
    """Ablation "SPAP w/o update" (paper Table 5): the penalty method (Alg. 1) and its least-squares
    refit of the kept columns, without the alternating minimisation of §3.3."""

    name = "spap_no_update"
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

