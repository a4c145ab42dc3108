"""Score-and-remove baselines: a per-channel importance on the dense model, no weight update.

They need only the dense model's per-channel statistics (``ChannelStats``), so they do not
propagate pruned activations and an ablation grid computes those statistics once for all of them.
Channel ``j`` is column ``j`` of the output projection ``W [d, n]`` and ``Z_j`` its input over the
N calibration tokens. Scores: higher = more important; each layer keeps its highest-scoring channels.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from spap_lib.checks import hp
from spap_lib.methods.base import LayerProblem, Method, PruneResult, Unsupported, highest, register
from spap_lib.methods.parts.selection import SELECTIONS
from spap_lib.model.adapters import MLP, Adapter
from spap_lib.numerics.stats import ChannelStats


@dataclass
class ScoreMethod(Method):
    """Base class: ``score`` ranks channels, ``allocation`` spreads the budget over layers; no update (the
    dense model's statistics decide everything, so nothing propagates). The same selection with an update
    is a layer-wise composition (``parts``): ``spap/select=<selection>,update=...``."""

    propagates = False
    fits = False  # scores only (FLAP's bias compensation is a mean, not a fit)
    scores_dense = True
    selection: ClassVar[str] = ""  # the part of ``parts.SELECTIONS`` this method's score is

    def score(self, mlp: MLP, stats: ChannelStats) -> torch.Tensor:
        return SELECTIONS[self.selection].score(self, mlp, stats)

    def parts(self) -> dict[str, str]:
        return {"select": self.selection, "allocation": self.allocation, "update": "none"}

    @classmethod
    def fixed_parts(cls) -> str:
        return (f"it ranks channels on the dense model's statistics without propagating, so no update (which fits "
                f"the pruned layers' activations) can follow it. The same selection with an update is the "
                f"layer-wise composition spap/select={cls.selection},update=ls (or alternating, gd)"
                + ("" if "allocation" in {f.name for f in dataclasses.fields(cls)} else
                   f"; its allocation is {cls.allocation} only"))

    def allocation_scores(self, mlp: MLP, stats: ChannelStats) -> torch.Tensor:
        return self.score(mlp, stats)

    def finish(self, mlp: MLP, keep: torch.Tensor, stats: ChannelStats) -> MLP:
        """The pruned MLP (default: the kept channels, weights unchanged)."""
        return mlp.select(keep)

    def select(self, mlp: MLP, stats: ChannelStats, n_remove: int, score: torch.Tensor | None = None) -> PruneResult:
        score = self.score(mlp, stats) if score is None else score
        keep = highest(score, mlp.width - n_remove)
        return PruneResult(self.finish(mlp, keep, stats), keep, {})

    def prune(self, problem: LayerProblem) -> PruneResult:
        # Sequential (per-layer) path, used when propagating: statistics of this layer's own inputs.
        return self.select(problem.dense, ChannelStats.of(problem.dense, problem.X, problem.chunk), problem.n_remove)


@register
@dataclass
class Magnitude(ScoreMethod):
    """Magnitude floor: ``‖W[:, j]‖₂`` of the output projection, no data, no update."""

    name = "magnitude"
    selection = "magnitude"


@register
@dataclass
class WandaSP(ScoreMethod):
    """Wanda-SP, the structured Wanda baseline of FLAP (An et al., AAAI 2024): Wanda's metric
    ``|W_ij|·‖X_j‖₂`` (Sun et al., ICLR 2024) summed over a column, ``S_j = Σ_i |W_ij| · ‖Z_j‖₂``. No update."""

    name = "wanda_sp"
    allocations = ("uniform", "global")
    allocation: str = "uniform"  # FLAP's Wanda-SP baseline is uniform; "global" = one standardised threshold
    selection = "wanda"


@register
@dataclass
class FLAP(ScoreMethod):
    """FLAP (An et al., "Fluctuation-based Adaptive Structured Pruning for LLMs", AAAI 2024): the
    weighted input-feature variance metric (WIFV) ``S_j = Var_t(Z_tj)·‖W[:, j]‖²``; the adaptive
    structure: one global threshold over layer-standardised scores; and the baseline bias
    compensation: the removed channels' mean contribution ``W[:, R] · mean_t(Z_tR)`` joins the bias.

    Models whose MLP has no output bias get one where stock transformers has a slot for it (Llama's
    ``mlp_bias``, which also adds zero biases to gate/up, counted in the achieved sparsity); where it
    has none (e.g. Gemma-3, Qwen2) ``bias=True`` is refused before any work: a checkpoint with an extra
    bias would load without it, silently. ``bias=False`` gives FLAP's selection without compensation.
    """

    name = "flap"
    allocations = ("uniform", "global")
    allocation: str = "global"
    bias: bool = True
    selection = "fluctuation"

    def prepare(self, adapter: Adapter) -> None:
        if not self.bias or adapter.has_out_bias():
            return
        if not adapter.can_add_out_bias():
            raise Unsupported(
                f"flap's bias compensation needs a bias on the MLP output projection, and "
                f"{adapter.model.config.model_type!r} has no slot for one in stock transformers (a checkpoint "
                "with an extra bias would load without it, silently). Pass hparams {'bias': False} for FLAP's "
                "selection without compensation."
            )
        adapter.enable_out_bias()

    def parts(self) -> dict[str, str]:
        return {**super().parts(), "update": "bias" if self.bias else "none"}  # the removed channels' mean

    @classmethod
    def fixed_parts(cls) -> str:
        return super().fixed_parts() + "; its own update, the bias compensation, is turned off by bias=false"

    def finish(self, mlp, keep, stats):
        out = mlp.select(keep)
        if self.bias:
            removed = torch.ones(mlp.width, dtype=torch.bool, device=keep.device)
            removed[keep] = False
            shift = mlp.W_out.double()[:, removed] @ stats.mean[removed]
            out.b_out = (shift if mlp.b_out is None else mlp.b_out.double() + shift).float()
        return out


@register
@dataclass
class CFSP(ScoreMethod):
    """CFSP (Wang et al., "CFSP: An Efficient Structured Pruning Framework for LLMs with Coarse-to-Fine
    Activation Information", 2024), MLP only. Coarse: per-block budgets from the angular distance
    between each block's input and output (``allocation="angular"``, controls ``a``/``scale``).
    Fine: the within-block score (the official code's default ``three_w_one_wa``, b = c = 1): for every
    projection, the relative importance of each weight within its channel, activation-weighted on the
    output side,

        S_j = mean_i [ |W_ij|‖Z_j‖ / Σ_k |W_kj|‖Z_j‖ + Σ_p |P_ji| / Σ_k |P_jk| ] · ‖Z_j‖,

    with ``P`` the input projections (gate, up; OPT: fc1). Each bracketed term is normalised within
    channel j, so the bracket is the same for every channel and the ranking within a block is by
    ‖Z_j‖ — exactly what the official code computes; the formula is kept literally for fidelity.
    """

    name = "cfsp"
    allocations = ("uniform", "angular")
    allocation: str = "angular"
    a: float = hp(1.0, ge=0)  # sigmoid sharpness of the block allocation (CFSP's --a)
    scale: float = hp(1e4, gt=0)  # divisor of the token-summed angular distances, as in CFSP's code
    selection = "act_norm"  # what its score ranks by (computed literally below)

    def score(self, mlp, stats):
        xnorm = stats.norm
        A = mlp.W_out.double().abs() * xnorm
        rel = A / A.sum(0).clamp_min(1e-30)  # [d, n], normalised per channel (column)
        for P in mlp.W_in:
            P = P.double().abs()  # [n, d]: channel j is row j
            rel = rel + (P / P.sum(1, keepdim=True).clamp_min(1e-30)).T
        return rel.mean(0) * xnorm
