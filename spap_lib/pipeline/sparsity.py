"""The sparsity plan: a share of decoder parameters → MLP channels removed per layer.

The budget counts parameters inside decoder layers; removing one MLP channel removes its row of every
input projection and its column of the output projection (``Adapter.params_per_channel``). ``round_to``
keeps every width a multiple of a block size, and the plan reports what it then achieves.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from spap_lib.checks import ParameterError, check_sparsity
from spap_lib.errors import option, option_name
from spap_lib.model.adapters import Adapter
from spap_lib.pipeline.blocks import round_to_value


@dataclass(frozen=True)
class SparsityPlan:
    """How an overall sparsity becomes a per-layer MLP channel count.

    Sparsity is the fraction of *decoder-layer* parameters removed (every parameter inside the
    decoder layers: attention, MLP, norms; not embeddings, final norm or LM head). Only MLP channels
    are removed, ``layers · n_remove`` in total with
    ``n_remove = round(sparsity · decoder_params / (layers · params_per_channel))``: the same number
    in every layer unless a method allocates the total differently (``spap_lib.methods.parts.allocation``).
    """

    sparsity: float
    decoder_params: int
    mlp_params: int
    layers: int
    width: int
    params_per_channel: int
    n_remove: int
    round_to: int | None = None  # every kept width a multiple of it, a non-uniform allocation's too
    # what the method adds to each layer (FLAP's bias slots): in all, at full width, and per channel
    added_params: int = 0
    added_per_channel: int = 0

    @property
    def mlp_share(self) -> float:
        return self.mlp_params / self.decoder_params

    @property
    def mlp_ratio(self) -> float:
        """Fraction of MLP channels removed."""
        return self.n_remove / self.width

    @property
    def achieved(self) -> float:
        """Share of the decoder's parameters the plan removes (``round_to`` moves it off ``sparsity``), net of what
        the method adds (``prepared``)."""
        removed = self.n_remove * (self.params_per_channel + self.added_per_channel) * self.layers
        return (removed - self.added_params) / self.decoder_params

    def prepared(self, adapter) -> SparsityPlan:
        """This plan with what a method's ``prepare`` added to ``adapter``'s model (a bias slot): the achieved
        share it prints before the run is then the one the run reports."""
        layer = adapter.layers()[0]
        return replace(self, added_params=adapter.decoder_params() - self.decoder_params,
                       added_per_channel=adapter.params_per_channel(layer) - self.params_per_channel)

    @property
    def max_sparsity(self) -> float:
        return (self.width - 1) * self.params_per_channel * self.layers / self.decoder_params


def channels_removed(sparsity: float, decoder_params: int, layers: int, params_per_channel: int, width: int,
                     round_to: int | None = None) -> int:
    """MLP channels removed per layer for ``sparsity`` of the decoder parameters, with the kept width the nearest
    multiple of ``round_to`` (at least one multiple): the count both the prune and the memory plan use."""
    n_remove = round(sparsity * decoder_params / (layers * params_per_channel))
    if round_to is None:
        return n_remove
    keep = max(round_to, round((width - n_remove) / round_to) * round_to)
    return max(0, width - keep)


def plan_sparsity(adapter: Adapter, sparsity: float, round_to: int | None = None) -> SparsityPlan:
    """``round_to``: make the kept width the nearest multiple of it (8/64/128: GEMM-friendly shapes);
    the achieved sparsity then moves off the requested one and is reported as measured. A non-uniform
    ``allocation`` spreads the same total over the layers, each kept width again a multiple
    (``allocation.rounded``)."""
    check_sparsity(sparsity)
    round_to = round_to_value(round_to)
    layers = adapter.layers()
    widths = {adapter.width(layer) for layer in layers}
    if len(widths) != 1:
        raise ParameterError(f"model already has non-uniform MLP widths {sorted(widths)}; prune a dense model")
    width = widths.pop()
    ppc = adapter.params_per_channel(layers[0])
    decoder = adapter.decoder_params()
    n_remove = channels_removed(sparsity, decoder, len(layers), ppc, width, round_to)
    plan = SparsityPlan(sparsity, decoder, adapter.mlp_params(), len(layers), width, ppc, n_remove, round_to)
    if sparsity > 0 and n_remove == 0:  # a run at full cost that changes nothing is refused, not reported after
        one = plan.params_per_channel * plan.layers / decoder
        why = (f"with {option('round_to', round_to)} the kept width rounds back to all {width}"
               if round_to is not None else
               f"that is less than one MLP channel per layer ({one:.4f} of the decoder parameters)")
        raise ParameterError(
            f"sparsity {sparsity} removes no MLP channel of width {width}: {why}. Use a larger sparsity"
            + (f" or {option_name('round_to')} well below {width}" if round_to is not None
               else f" (at least {one:.4f})")
            + " (sparsity 0 saves the dense model unchanged)")
    if n_remove >= width:
        raise ParameterError(
            f"sparsity {sparsity} would remove all {width} MLP channels of every layer: spap prunes MLP "
            f"channels only, which are {plan.mlp_share:.1%} of decoder parameters; the most it can "
            f"remove while keeping one channel is {plan.max_sparsity:.4f}. Choose a lower sparsity."
        )
    return plan
