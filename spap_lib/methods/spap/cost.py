"""The compositions' cost model for the plan (``spap plan``): the work of one decoder layer's prune, by stage and
rate, with the stages of SPAP's parts (Alg. 1's solves, the update's rounds); registered for every composition.
"""
from __future__ import annotations

from spap_lib.methods import cost_model
from spap_lib.methods.cost_model import Shapes, chunks_of, solve_flops
from spap_lib.methods.parts.allocation import ALLOCATIONS
from spap_lib.methods.parts.composition import Composition
from spap_lib.methods.parts.curves import curve_points
from spap_lib.methods.parts.selection import SELECTIONS
from spap_lib.numerics.linalg import gram_flops


def layer_cost(m: Composition, s: Shapes) -> dict[str, dict[str, float]]:
    """The dense Gram pass, the selection (K penalty solves and the refit, or one refit; a statistics pass
    for a score needing channel means), then (rounds) the update: Adam's forward and backward products,
    each round's pass over its token sample and its solve, and the final refit on every token when the
    rounds were cheap (a sample or bf16)."""
    stages = cost_model.layer_cost(m, s)
    one_refit = stages.pop("refit solve")
    if m.select == "penalty":  # with ``patience``, as where the first marked set stays (every layer measured)
        iters = min(m.K, m.patience + 1) if m.patience else m.K
        stages["penalty / refit solves"] = {"solve": (iters + 1) * solve_flops(s.n + 1, s.d), "steps": iters + 1}
    elif m.refits:
        stages["refit solve"] = one_refit
    if "channel_mean" in SELECTIONS[m.select].needs:
        stages["channel statistics"] = {"fp32": 2 * s.in_proj * s.N * s.d * s.n, "steps": chunks_of(s.N, s.chunk)}
    if m.concentrated < 1 and m.refits and not m.uses_targets:  # ``concentration``'s forward
        stages["output energies"] = {"fp32": 2 * (s.in_proj + 1) * s.N * s.d * s.n,
                                     "steps": chunks_of(s.N, s.chunk)}
    if "curves" in ALLOCATIONS[m.allocation].needs:  # each layer's curve: a Gram pass on a sample, its errors
        alloc_tokens = m.allocation_tokens(s.N)
        curve_tokens, points = min(m.error_tokens, alloc_tokens), curve_points(s.n)
        # reading every token of the pass, the curve's Gram pass takes the channel statistics ("dense channel
        # statistics" prices its forward); on a sample, a forward of its own
        forward = 2 * s.in_proj * curve_tokens * s.d * s.n if curve_tokens < alloc_tokens else 0
        # each token's output energy; "residual" reads the block outputs' energies, N·d
        weigh = 2 * curve_tokens * s.n * s.d if m.error_weight == "token" else 0
        kept = [s.n - r + 1 for r in points]
        # a float64 quadratic form per point (update none), or one float64 factorisation and forward solve of
        # the whole layer and a back-solve per point (``nested_lstsq_errors``); priced at the solves' rate
        solves = sum(2 * k * k * s.d for k in kept) if not m.refits else \
            (s.n + 1) ** 3 / 3 + (s.n + 1) ** 2 * s.d + sum(k * k * s.d for k in kept)
        stages["error curves"] = {"fp32": forward + gram_flops(curve_tokens, s.n) + weigh,
                                  "solve": solves, "steps": chunks_of(curve_tokens, s.chunk) + len(points) + 1}
    if not m.rounds_update or not m.am_iters:
        return stages
    rate = "bf16" if m.update_precision == "bf16" else "fp32"  # the rounds' products (``linalg.products``)
    round_tokens = min(m.sketch_tokens or s.N, s.N)  # the rounds' token sample
    refit = round_tokens < s.N or rate == "bf16"  # the best round refitted on every token at ``precision``
    mlp = 2 * (s.in_proj + 1) * s.d * s.n_keep  # per token: the pruned MLP's forward
    steps = m.am_iters * m.adam_steps
    stages["Adam steps"] = {rate: steps * min(m.batch_tokens, s.N) * 3 * mlp, "steps": steps}
    passes = m.am_iters * chunks_of(round_tokens, s.chunk) + (chunks_of(s.N, s.chunk) if refit else 0)
    if not m.closed_form_rounds:  # gd: every round a forward pass for the error on the rounds' sample
        rounds = {rate: m.am_iters * round_tokens * mlp}
        rounds["fp32"] = rounds.get("fp32", 0) + (s.N * mlp if refit else 0)
        stages["alternating rounds (Gram / error)"] = rounds | {"steps": passes}
        return stages
    # alternating: ``Z`` and ``Y Zᵀ`` in the rounds' precision, ``Z Zᵀ`` in float32, and (resampled) the
    # ranking forward pass on the first sample; one solve per round and per refit
    z_yz = 2 * s.in_proj * s.d * s.n_keep + 2 * s.d * s.n_keep  # per token
    resampled = m.sketch_resample and round_tokens < s.N
    ranking = min(m.rank_tokens or round_tokens, s.N) if resampled else 0  # the ranking sample's tokens
    rounds = {rate: m.am_iters * (round_tokens * z_yz + ranking * mlp)}
    rounds["fp32"] = rounds.get("fp32", 0) + m.am_iters * gram_flops(round_tokens, s.n_keep)
    if refit:  # ``Z`` and ``Y Zᵀ`` at ``refit_precision``, ``Z Zᵀ`` in float32 either way
        final = "bf16" if m.refit_precision == "bf16" else "fp32"
        rounds[final] = rounds.get(final, 0) + s.N * z_yz
        rounds["fp32"] += gram_flops(s.N, s.n_keep)
    stages["alternating rounds (Gram / error)"] = rounds | {"steps": passes}
    stages["alternating rounds (solves)"] = {"solve": (m.am_iters + refit) * solve_flops(s.n_keep, s.d),
                                             "steps": m.am_iters + refit}
    return stages


def token_samples(m: Composition, s: Shapes) -> float:
    """The rounds' samples of ``X`` and ``Y`` rows (``subsample``; every token is no copy): one of
    ``sketch_tokens``, and resampled, the ranking sample of ``rank_tokens`` beside each round's fresh one."""
    if not m.rounds_update or not m.am_iters or not 0 < m.sketch_tokens < s.N:
        return 0.0
    resampled = m.sketch_resample and m.closed_form_rounds
    ranking = min(m.rank_tokens or m.sketch_tokens, s.N) if resampled else 0
    tokens = m.sketch_tokens + (ranking if ranking < s.N else 0)
    return tokens * 2 * s.d * s.weight_bytes


cost_model.priced(Composition, cost=layer_cost, token_samples=token_samples)
