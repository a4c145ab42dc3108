"""The memory and work model of a method's layer: what the plan (``spap plan``, ``spap_lib.pricing``) prices.

``Shapes`` are the sizes a layer's cost depends on. A method's pricing is not part of the method: each method class
registers its own where it differs (``priced``: the compositions in ``methods/spap/cost.py``, SliceGPT beside
itself), and the plan asks ``pricing(method)``. The defaults here serve every layer-wise method: ``layer_cost``
counts the floating-point work by stage and rate, ``working_set`` and ``host_set`` the bytes it holds while it
prunes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from spap_lib.methods.base import Method
from spap_lib.methods.parts.allocation import ALLOCATIONS
from spap_lib.numerics.linalg import GRAM_BLOCKS, gram_flops


@dataclass(frozen=True)
class Shapes:
    """What a method's cost depends on, per decoder layer (``Pricing``): ``N``
    calibration tokens, hidden size ``d``, MLP width ``n`` of which ``n_keep`` are kept, ``in_proj`` input
    projections (gate and up: 2; fc1: 1), ``chunk`` tokens per Gram pass, ``solve_bytes`` per number of the
    method's precision and ``weight_bytes`` of the model's dtype, and the vocabulary ``vocab`` with ``tied``
    embeddings.
    ``streamed``: ``X`` and ``Y`` wait in host memory and reach the device a chunk at a time (offloaded from a GPU),
    so what is drawn from them (``Pricing.token_samples``) waits there too."""

    N: int
    d: int
    n: int
    n_keep: int
    in_proj: int
    chunk: int
    solve_bytes: int
    weight_bytes: int
    vocab: int
    tied: bool
    streamed: bool = False


def chunks_of(N: int, chunk: int) -> int:
    """How many chunks a pass over ``N`` tokens takes (``Pricing.cost``'s sequential steps)."""
    return -(-N // chunk)


def solve_flops(m: int, d: int) -> float:
    """One Cholesky factorisation of an ``m × m`` Gram matrix and its solve for ``d`` right-hand sides."""
    return m**3 / 3 + 2 * m**2 * d


def layer_cost(m: Method, s: Shapes) -> dict[str, dict[str, float]]:
    """The work of one decoder layer's prune, by stage, each split by the rate that runs it (``spap_lib.plan``'s
    throughput rows): floating-point operations of ``"fp32"`` products (TF32 where the precision says so),
    ``"bf16"`` products and ``"solve"`` (Cholesky at the method's precision), and ``"steps"``, the stage's
    sequential steps (a chunk of a pass, a solve, an Adam step: on a GPU each costs its kernel launches and a
    synchronisation whatever its size). The calibration forward passes and the evaluation are the plan's
    own. Here: a fitting method's dense Gram pass (with the targets ``Y`` where it uses them) and one
    least-squares refit, or a score method's channel statistics; and, for an allocation that reads the dense
    channels (its ``needs``: ``channel_stats``), the dense pass's channel statistics of a fitting method."""
    chunks = chunks_of(s.N, s.chunk)
    stats = {"fp32": 2 * s.in_proj * s.N * s.d * s.n, "steps": chunks}  # every channel's Z over the tokens
    if not m.fits:
        return {"channel statistics": stats}
    gram = 2 * s.in_proj * s.N * s.d * s.n + gram_flops(s.N, s.n)
    targets = 2 * s.N * s.d * s.n if m.uses_targets else 0  # Y = W Z from the same pass
    alloc_tokens = m.allocation_tokens(s.N)  # the dense pass that decides the widths
    allocating = {"dense channel statistics": {"fp32": 2 * s.in_proj * alloc_tokens * s.d * s.n, "steps": chunks_of(
        alloc_tokens, s.chunk)}} if "channel_stats" in ALLOCATIONS[m.allocation].needs else {}
    return {**allocating, "dense Gram pass": {"fp32": gram + targets, "steps": chunks},
            "refit solve": {"solve": solve_flops(s.n + 1, s.d), "steps": 1}}


def working_set(m: Method, s: Shapes) -> dict[str, float]:
    """Bytes the method holds on the device while it prunes one layer, beyond the weights and the calibration
    activations: the parts of its largest stage (the stages run one after another; only the dense MLP lives through
    all of them: a float32 copy ``(in_proj+1)·d·n·4`` of weights in another dtype, the layer's own float32
    ones). ``c`` tokens per chunk, ``k = n_keep``:

    * the dense pass: the Gram matrix ``(n+1)²·p``; a chunk's activations (two ``[c, n]`` at their peak,
      ``MLP.hidden``), inputs and targets, ``c·(2n + 2d)·4``, and one block of ``Zᵀ Z`` (``linalg.add_gram``:
      ``⌈(n+1)/B⌉`` rows, float32 and the sum's precision);
    * the solves: the Gram matrix and the damped system factorised in place, ``2·(n+1)²·p``
      (``linalg.solve_spd``); ``Y Zᵀ``, ``W`` and the right-hand sides ``3·d·(n+1)·p``;
    * the update's rounds (``uses_targets``; the dense Gram released): a round's Gram matrix and its system
      ``2·(k+1)²·p``, ``Y Zᵀ`` and ``W`` ``2·d·(k+1)·p``, the pruned MLP with its gradients and Adam's two moments
      ``(4·in_proj+1)·d·k·4``, a chunk at width ``k``. The final refit that follows (Adam's state freed first)
      holds the trained MLP and the best round's copy, ``2·(in_proj+1)·d·k·4``, with a solve at width ``k`` and the
      error's float64 blocks (``ERROR_BLOCK`` rows): never more than a round, so it is not a stage of its own.
      The rounds' token samples (``token_samples``) are part of it where ``X`` and ``Y`` are on the device."""
    if not m.fits:
        return {}
    proj, c, k = s.in_proj, min(s.chunk, s.N), s.n_keep
    p, b = s.solve_bytes, s.weight_bytes  # the symbols above

    def chunk_and_block(width: int) -> int:
        return c * (2 * width + 2 * s.d) * 4 + -(-(width + 1) // GRAM_BLOCKS) * (width + 1) * (4 + p)

    dense = {"dense MLP (float32)": (proj + 1) * s.d * s.n * 4} if b != 4 else {}  # ``Adapter.get_mlp``
    stages = {
        "dense pass": {"Gram matrix": (s.n + 1) ** 2 * p, "a chunk and its Gram block": chunk_and_block(s.n)},
        "solves": {"Gram matrix + factor (2 n², in place)": 2 * (s.n + 1) ** 2 * p,
                   "Y Zᵀ, W, right-hand sides": 3 * s.d * (s.n + 1) * p}}
    if m.uses_targets:
        stages["update rounds"] = {"a round's Gram matrix + factor": 2 * (k + 1) ** 2 * p,
                                   "Y Zᵀ, W": 2 * s.d * (k + 1) * p,
                                   "pruned MLP, gradients, Adam moments": (4 * proj + 1) * s.d * k * 4,
                                   "a chunk and its Gram block": chunk_and_block(k)}
        samples = pricing(m).token_samples(m, s)
        if samples and not s.streamed:
            stages["update rounds"]["token samples"] = samples
    stage = max(stages, key=lambda name: sum(stages[name].values()))
    return dense | {f"{part} ({stage})": v for part, v in stages[stage].items()}


def host_set(m: Method, s: Shapes) -> dict[str, float]:
    """Bytes the method keeps in host memory while it prunes a layer (a CPU's one memory: its device's too): the
    update's start and best round (``best_round``), float32 copies of the pruned MLP, and where ``X`` and ``Y``
    stream from host memory the rounds' token samples drawn from them."""
    if not m.uses_targets:
        return {}
    held = {"update's start and best round": 2 * (s.in_proj + 1) * s.d * s.n_keep * 4}
    samples = pricing(m).token_samples(m, s)
    return held | ({"update's token samples": samples} if s.streamed and samples else {})


def no_samples(m: Method, s: Shapes) -> float:
    """Bytes of the copies of ``X`` and ``Y`` rows an update draws for its rounds: none."""
    return 0.0


@dataclass(frozen=True)
class Pricing:
    """How the plan prices one layer of a method, each hook taking ``(method, Shapes)``: ``cost`` its work by stage
    and rate, ``working_set`` the bytes it holds on the device beyond weights and activations, ``host_set`` those
    kept in host memory, ``token_samples`` the bytes of the ``X`` and ``Y`` rows its rounds draw, held where ``X``
    and ``Y`` are."""

    cost: Callable[[Method, Shapes], dict] = layer_cost
    working_set: Callable[[Method, Shapes], dict] = working_set
    host_set: Callable[[Method, Shapes], dict] = host_set
    token_samples: Callable[[Method, Shapes], float] = no_samples


PRICES: dict[type, Pricing] = {}


def priced(cls: type[Method], **hooks: Callable) -> None:
    """Register how ``cls`` and its subclasses are priced where they differ from the defaults (``Pricing``)."""
    PRICES[cls] = Pricing(**hooks)


def pricing(m: Method) -> Pricing:
    """The pricing of the nearest class of ``m`` that registered one, else the defaults."""
    return next((PRICES[c] for c in type(m).__mro__ if c in PRICES), Pricing())
