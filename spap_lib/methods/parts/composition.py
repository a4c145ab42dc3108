"""The layer-wise composition of the three parts (``parts``): a selection, an allocation and an update, with what
every one of them reads. ``spap``, its ablations and ``fasp`` are presets of it (``methods/spap``, ``methods/fasp.py``);
any other composition is one label, e.g. ``spap/select=act_norm,allocation=error``.

A part that has hyperparameters of its own (the penalty method, the update's rounds) declares them as a settings
dataclass (``Part.settings``) that a preset carries as a mixin; the composition asks the parts, never their names.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from spap_lib.checks import hp
from spap_lib.errors import ParameterError
from spap_lib.methods.base import METHODS, LayerProblem, Method, PruneResult, highest
from spap_lib.methods.parts.allocation import ALLOCATIONS
from spap_lib.methods.parts.curves import error_curve
from spap_lib.methods.parts.registry import Part
from spap_lib.methods.parts.selection import SELECTIONS, UPDATES
from spap_lib.model.adapters import MLP
from spap_lib.numerics.collective import total
from spap_lib.numerics.linalg import PRECISION_CHOICES, mean_diag
from spap_lib.numerics.solve import lstsq_columns, reconstruction_error, with_bias
from spap_lib.numerics.stats import ChannelStats


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
        for kind, part in (("selection", SELECTIONS[self.select]), ("update", UPDATES[self.update])):
            if part.settings is not None and not isinstance(self, part.settings):
                raise ParameterError(f"method {self.name!r} does not carry the settings of the {kind} {part.name!r}: "
                                     f"choose another {kind} ({', '.join(self._carried(kind))}), or use "
                                     f"{' or '.join(n for n, c in METHODS.items() if issubclass(c, part.settings))}")

    def _carried(self, kind: str) -> list[str]:
        """The parts of ``kind`` whose settings this method carries (or that have none)."""
        registry = SELECTIONS if kind == "selection" else UPDATES
        return [k for k, p in registry.items() if p.settings is None or isinstance(self, p.settings)]

    def _chosen(self) -> tuple[Part, Part]:
        return SELECTIONS[self.select], UPDATES[self.update]

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
        return SELECTIONS[self.select].score(self, mlp, stats)

    def effective_hparams(self) -> dict:
        """The settings of parts not chosen are inert (the penalty method's without it, the rounds' without rounds),
        and those a chosen part's own settings make inert (``inert``); the refit's without a refit, the damping when
        nothing is solved for, the error curve's and the dense pass's without an allocation that reads them."""
        chosen = {p.settings for p in self._chosen() if p.settings is not None}
        carried = {p.settings for registry in (SELECTIONS, UPDATES) for p in registry.values()
                   if p.settings is not None and isinstance(self, p.settings)}
        inert = {f.name for settings in carried - chosen for f in fields(settings)}
        for settings in chosen:
            inert |= settings.inert(self) if hasattr(settings, "inert") else set()
        if not self.refits:
            inert |= {"anchor", "concentrated"}  # nothing is refitted
            if "solves" not in SELECTIONS[self.select].needs:
                inert.add("damp")  # nothing is solved for
        if "curves" not in ALLOCATIONS[self.allocation].needs:
            inert |= {"error_tokens", "error_weight"}
        if "dense_pass" not in ALLOCATIONS[self.allocation].needs:
            inert |= {"allocation_sample", "allocation_precision"}
        return {k: v for k, v in self.hparams().items() if k not in inert}

    def channel_stats(self, mlp: MLP, X: torch.Tensor, H: torch.Tensor, chunk: int) -> ChannelStats:
        """What the selection's score reads: ``‖Z_j‖`` from the Gram diagonal, or a pass over the tokens for a
        score that needs channel means (its ``needs``: ``channel_mean``)."""
        if "channel_mean" in SELECTIONS[self.select].needs:
            return ChannelStats.of(mlp, X, chunk)
        return ChannelStats.norms(torch.diagonal(H)[:mlp.width], total(X.shape[0]))  # every rank's tokens

    def choose(self, problem: LayerProblem) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
        """The selection: the kept channels (sorted), the penalty method's own refitted output projection (Alg. 1's
        last step; ``None`` for the other selections) and diagnostics."""
        part, dense = SELECTIONS[self.select], problem.dense
        if part.choose is not None:
            return part.choose(self, problem)
        stats = self.channel_stats(dense, problem.X, problem.H, problem.chunk)
        return highest(part.score(self, dense, stats), dense.width - problem.n_remove), None, {}

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
