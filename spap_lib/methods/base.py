"""The interface every pruning method shares, and the method registry.

The pipeline (``spap_lib.pipeline.sequential``) owns the data flow: it hands each method one ``LayerProblem``
per decoder layer, built from the *current* (already pruned upstream) activations, and writes the
returned ``MLP`` back into the model. Methods only see tensors.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property
from typing import ClassVar

import torch

from spap_lib.checks import ParameterError, check_fields, scalar
from spap_lib.methods.parts import allocation as alloc
from spap_lib.model.adapters import MLP
from spap_lib.numerics.linalg import (
    GRAM_BLOCKS,
    PRECISIONS,
    check_finite,
    chunk_for,
    gram,
    gram_and_outputs,
    gram_flops,
    outputs,
    resolve_precision,
    sq_norm,
    token_energies,
    top_share,
)


@dataclass(frozen=True)
class Shapes:
    """What a method's cost depends on, per decoder layer (``Method.cost``, ``Method.working_set``): ``N``
    calibration tokens, hidden size ``d``, MLP width ``n`` of which ``n_keep`` are kept, ``in_proj`` input
    projections (gate and up: 2; fc1: 1), ``chunk`` tokens per Gram pass, ``p`` bytes per number of the
    method's precision and ``b`` of the model's dtype, and the vocabulary ``vocab`` with ``tied`` embeddings.
    ``streamed``: ``X`` and ``Y`` wait in host memory and reach the device a chunk at a time (offloaded from a GPU),
    so what is drawn from them (``Method.token_samples``) waits there too."""

    N: int
    d: int
    n: int
    n_keep: int
    in_proj: int
    chunk: int
    p: int
    b: int
    vocab: int
    tied: bool
    streamed: bool = False


def highest(score: torch.Tensor, n_keep: int) -> torch.Tensor:
    """The indices of the ``n_keep`` highest scores, sorted: the channels a score keeps."""
    return torch.sort(torch.topk(score, n_keep).indices).values


def chunks_of(N: int, chunk: int) -> int:
    """How many chunks a pass over ``N`` tokens takes (``Method.cost``'s sequential steps)."""
    return -(-N // chunk)


def solve_flops(m: int, d: int) -> float:
    """One Cholesky factorisation of an ``m × m`` Gram matrix and its solve for ``d`` right-hand sides."""
    return m**3 / 3 + 2 * m**2 * d


@dataclass
class LayerProblem:
    """Everything a method may use to prune one MLP.

    ``X`` are the MLP inputs (after the layer's norm) for all calibration tokens ``[N, d]``, in the
    model's dtype (one copy; every use upcasts a chunk at a time); the target is the dense MLP's
    output on the same inputs, ``Y = dense(X)``.
    """

    dense: MLP
    X: torch.Tensor
    n_remove: int
    chunk: int = 8192  # tokens per pass when accumulating Gram matrices (memory bound, not math)
    seed: int = 0
    layer_index: int = 0
    dtype: torch.dtype = torch.float64  # Gram accumulation and solves (the method's ``precision``)
    # The method will ask for the dense targets ``Y`` (``Method.uses_targets``): then the first of ``H``
    # and ``Y`` to be asked for computes both in one pass over the tokens.
    targets: bool = False

    @classmethod
    def of(cls, method: "Method", dense: MLP, X: torch.Tensor, n_remove: int, device=None, **kw) -> "LayerProblem":
        """The problem as ``method`` will see it: Gram sums and solves in its precision resolved for
        ``device`` (default: the dense MLP's), and its targets computed in the Gram pass when it uses them."""
        precision = resolve_precision(method.precision, dense.W_out.device if device is None else device)
        kw["chunk"] = chunk_for(dense.width, kw.get("chunk", cls.chunk))  # memory-bound at wide layers
        return cls(dense, X, n_remove, dtype=PRECISIONS[precision], targets=method.uses_targets, **kw)

    @property
    def has_bias(self) -> bool:
        return self.dense.b_out is not None

    @cached_property
    def Y(self) -> torch.Tensor:
        """Dense outputs ``[N, d]`` in the dtype of ``X`` (the Adam steps need them per token): one
        copy, computed a chunk at a time; recomputing them per step would cost a dense forward each."""
        if self.targets and "H" not in self.__dict__:
            self._dense_pass()
            return self.__dict__["Y"]
        return outputs(self.dense, self.X, self.chunk)

    @cached_property
    def H(self) -> torch.Tensor:
        """Gram matrix ``Z̃ Z̃ᵀ`` of the dense intermediate activations (``Z̃ = [Z; 1]`` with bias)."""
        if self.targets and "Y" not in self.__dict__:
            self._dense_pass()
            return self.__dict__["H"]
        H = gram(self.dense, self.X, self.chunk, dtype=self.dtype)
        check_finite(H, f"layer {self.layer_index}: the Gram matrix entries")
        return H

    @cached_property
    def YY(self) -> float:
        """``‖Y‖²``, what this layer's relative errors divide by (floored at the smallest float64: ``Y = 0`` gives
        absolute errors)."""
        return max(sq_norm(self.Y, self.chunk, self.dense.W_out.device), torch.finfo(torch.float64).tiny)

    @cached_property
    def concentration(self) -> float:
        """The share of ``‖Y‖²`` that the largest 1% of the tokens hold: small in most layers, most of it where a few
        positions carry massive activations (docs/method.md: Three parts, composed). From ``Y`` where it exists, else
        one forward pass of the dense MLP."""
        device = self.dense.W_out.device
        if "Y" in self.__dict__:
            energies = token_energies(self.Y, self.chunk, device)
        else:
            energies = token_energies(self.X, self.chunk, device, mlp=self.dense)
        return top_share(energies)

    def _dense_pass(self) -> None:
        """``H`` and ``Y`` from one pass (``gram_and_outputs``: the same numbers as computing each alone)."""
        H, Y = gram_and_outputs(self.dense, self.X, self.chunk, dtype=self.dtype)
        check_finite(H, f"layer {self.layer_index}: the Gram matrix entries")
        self.__dict__.update(H=H, Y=Y)

    def release_gram(self) -> None:
        """Drop the dense Gram matrix once the method is done with it: ``n²`` numbers, a layer's largest state
        (docs/scale.md: Memory per layer). An update that accumulates its own Gram matrices then
        holds two such buffers on the device at a time, not three."""
        self.__dict__.pop("H", None)

    @property
    def nothing_to_fit(self) -> bool:
        """On these tokens the output does not depend on any channel: every ``Z_j`` is zero (e.g. an
        all-zero input projection) or the output projection is all zero. Any refit would divide by
        ``‖Z‖ = 0``; the dense weights of whichever channels are kept already give the same output."""
        n = self.dense.width
        return bool(torch.diagonal(self.H)[:n].sum() == 0) or not bool(self.dense.W_out.any())

    def keep_dense(self, info: dict | None = None) -> "PruneResult":
        """The ``nothing_to_fit`` answer: keep the channels with the largest output columns, weights as they are."""
        score = self.dense.W_out.double().norm(dim=0)
        keep = highest(score, self.dense.width - self.n_remove)
        return PruneResult(self.dense.select(keep), keep, {**(info or {}), "nothing_to_fit": True})


class Unsupported(ParameterError):
    """A method cannot prune this architecture (raised by ``Method.prepare``, before any work)."""


@dataclass
class PruneResult:
    mlp: MLP
    keep: torch.Tensor  # indices of the dense channels kept, sorted
    info: dict = field(default_factory=dict)  # per-layer diagnostics (errors, iterations)


class Method:
    """Base class: subclasses are dataclasses whose fields are the method's hyperparameters.

    Each field declares its type by annotation and its range with ``checks.hp(...)``; every instance
    is checked on construction, so the API, the notebooks and the grid refuse the same values with
    the same message before any work.
    """

    name: str = ""
    # The paper's own method (True) or a baseline; an ablation names the method it ablates. Figures and
    # tables list baselines first, then the ablations, then the method (``figures.method_order``).
    ours: ClassVar[bool] = False
    ablation_of: ClassVar[str | None] = None
    # Whether calibration inputs of layer i+1 come from the pruned layer i. Methods that only
    # score dense weights do not need it, which lets a grid reuse dense statistics.
    propagates: ClassVar[bool] = True
    # Whether weights are refitted by least squares on calibration activations (then too few
    # calibration tokens make the fit underdetermined, which ``api.prune`` warns about).
    fits: ClassVar[bool] = True
    # Whether ``prune`` uses the dense targets ``Y`` per token (the update's Adam steps): the pipeline then
    # has ``LayerProblem`` compute them in the Gram pass.
    uses_targets: ClassVar[bool] = False
    # How the channel budget may be spread over layers: the ones a method offers, and its choice (a
    # hyperparameter field in methods that offer more than one).
    allocations: ClassVar[tuple[str, ...]] = ("uniform",)
    allocation: ClassVar[str] = "uniform"
    # The share of the calibration windows whose dense pass decides a propagating method's non-uniform widths
    # (``pipeline.allocation_inputs``; a hyperparameter where a method offers it): all of them by default.
    allocation_sample: ClassVar[float] = 1.0
    # The products of that dense pass's replay: "full" (the model's own) or "bf16" (``linalg.products``: bf16 inputs,
    # float32 sums; the hidden states stay float32). A hyperparameter where a method offers it.
    allocation_precision: ClassVar[str] = "full"
    # CFSP's angular allocation, keep_l ∝ sigmoid(a·(I_l − mean I)/scale) (CFSP's hyperparameters; these
    # defaults serve other methods that offer allocation="angular").
    a: ClassVar[float] = 1.0
    scale: ClassVar[float] = 1e4
    # Whether channels are chosen by a score of the dense layer alone (no fit): without propagation,
    # one pass of dense statistics then serves every layer.
    scores_dense: ClassVar[bool] = False
    # Gram accumulation and solve precision; methods that solve declare it as a hyperparameter.
    precision = "float64"
    # Hyperparameters added with the earlier behaviour as their default: a result recorded before one of them
    # existed ran that default (``grid.ran_with``).
    introduced: ClassVar[tuple[str, ...]] = ()
    # Whether the method transforms the whole model (``prune_model``: SliceGPT slices the residual
    # stream) instead of pruning each MLP's channels (``prune``: everything else).
    whole_model: ClassVar[bool] = False

    def __post_init__(self) -> None:
        check_fields(self)
        self.validate()

    def validate(self) -> None:
        choice = self.allocation
        if choice not in self.allocations:
            raise ParameterError(f"method {self.name!r} supports allocation {' or '.join(self.allocations)}, "
                                 f"not {choice!r}")

    def parts(self) -> dict[str, str]:
        """The method's selection, allocation and update (``methods.parts``); empty for a whole-model method."""
        return {}

    @classmethod
    def fixed_parts(cls) -> str:
        """Why a part that this method does not take as a hyperparameter cannot be set (``get_method``)."""
        return "its parts are fixed"

    def error_curve(self, mlp: MLP, X: torch.Tensor, chunk: int, residual: torch.Tensor | None = None,
                    stats=None) -> tuple:
        """One dense layer's ``ChannelStats`` (``stats`` where given) and its ``(channels removed, relative error)``
        curve, from its inputs ``X`` and ``residual``, the energies of the hidden states its outputs are added to,
        per token of ``X``; for ``allocation="error"``."""
        raise NotImplementedError

    def allocation_scores(self, mlp: MLP, stats) -> torch.Tensor:
        """Per-channel importance on dense statistics, for ``allocation="global"``."""
        raise NotImplementedError

    def removals(self, stats: list, width: int, total: int, scores: list[torch.Tensor] | None = None) -> list[int]:
        """Channels to remove per layer, summing to ``total`` (``stats``: dense ``ChannelStats``;
        ``scores``: every layer's ``allocation_scores``, for ``allocation="global"``)."""
        choice = self.allocation
        if choice == "global":
            return alloc.global_standardized(scores, total)
        if choice == "angular":
            return alloc.angular([s.angular for s in stats], width, total, a=self.a, scale=self.scale)
        if choice == "error":
            return alloc.by_error([s.curve for s in stats], total)
        return [total // len(stats)] * len(stats)

    def allocation_tokens(self, N: int) -> int:
        """Of ``N`` calibration tokens, about how many the dense pass that decides the widths reads
        (``allocation_sample``; whole windows in the pipeline, ``allocation_inputs``)."""
        return max(1, round(N * self.allocation_sample))

    def prepare(self, adapter) -> None:
        """Check (and adapt) the architecture before any work is done; raise if it cannot be pruned."""

    def prune(self, problem: LayerProblem) -> PruneResult:
        raise NotImplementedError

    def prune_model(self, loaded, calib, sparsity: float, *, batch_size: int, progress: bool) -> dict:
        """Whole-model methods (``whole_model``): transform ``loaded.model`` in place; return timings,
        per-layer diagnostics and the plan as data (``plan``), what ``spap_lib.load`` re-applies."""
        raise NotImplementedError

    def hparams(self) -> dict:
        return dataclasses.asdict(self)

    def effective_hparams(self) -> dict:
        """The hyperparameters that decide this instance's result: ``hparams()`` less those that its other
        settings make inert. A grid row recorded before an inert option existed is still current."""
        return self.hparams()

    def cost(self, s: Shapes) -> dict[str, dict[str, float]]:
        """The work of one decoder layer's prune, by stage, each split by the rate that runs it (``spap_lib.plan``'s
        throughput rows): floating-point operations of ``"fp32"`` products (TF32 where the precision says so),
        ``"bf16"`` products and ``"solve"`` (Cholesky at the method's precision), and ``"steps"``, the stage's
        sequential steps (a chunk of a pass, a solve, an Adam step: on a GPU each costs its kernel launches and a
        synchronisation whatever its size). The calibration forward passes and the evaluation are the plan's
        own. Here: a fitting method's dense Gram pass (with the targets ``Y`` where it uses them) and one
        least-squares refit, or a score method's channel statistics; and, for an allocation that reads the dense
        channels (``allocation.READS_CHANNELS``), the dense pass's channel statistics of a fitting method."""
        chunks = chunks_of(s.N, s.chunk)
        stats = {"fp32": 2 * s.in_proj * s.N * s.d * s.n, "steps": chunks}  # every channel's Z over the tokens
        if not self.fits:
            return {"channel statistics": stats}
        gram = 2 * s.in_proj * s.N * s.d * s.n + gram_flops(s.N, s.n)
        targets = 2 * s.N * s.d * s.n if self.uses_targets else 0  # Y = W Z from the same pass
        Na = self.allocation_tokens(s.N)  # the dense pass that decides the widths
        allocating = {"dense channel statistics": {"fp32": 2 * s.in_proj * Na * s.d * s.n, "steps": chunks_of(
            Na, s.chunk)}} if alloc.READS_CHANNELS[self.allocation] else {}
        return {**allocating, "dense Gram pass": {"fp32": gram + targets, "steps": chunks},
                "refit solve": {"solve": solve_flops(s.n + 1, s.d), "steps": 1}}

    def working_set(self, s: Shapes) -> dict[str, float]:
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
        if not self.fits:
            return {}
        m, c, k = s.in_proj, min(s.chunk, s.N), s.n_keep

        def chunk_and_block(width: int) -> int:
            return c * (2 * width + 2 * s.d) * 4 + -(-(width + 1) // GRAM_BLOCKS) * (width + 1) * (4 + s.p)

        dense = {"dense MLP (float32)": (m + 1) * s.d * s.n * 4} if s.b != 4 else {}  # ``Adapter.get_mlp``
        stages = {
            "dense pass": {"Gram matrix": (s.n + 1) ** 2 * s.p, "a chunk and its Gram block": chunk_and_block(s.n)},
            "solves": {"Gram matrix + factor (2 n², in place)": 2 * (s.n + 1) ** 2 * s.p,
                       "Y Zᵀ, W, right-hand sides": 3 * s.d * (s.n + 1) * s.p}}
        if self.uses_targets:
            stages["update rounds"] = {"a round's Gram matrix + factor": 2 * (k + 1) ** 2 * s.p,
                                       "Y Zᵀ, W": 2 * s.d * (k + 1) * s.p,
                                       "pruned MLP, gradients, Adam moments": (4 * m + 1) * s.d * k * 4,
                                       "a chunk and its Gram block": chunk_and_block(k)}
            samples = self.token_samples(s)
            if samples and not s.streamed:
                stages["update rounds"]["token samples"] = samples
        stage = max(stages, key=lambda name: sum(stages[name].values()))
        return dense | {f"{part} ({stage})": v for part, v in stages[stage].items()}

    def host_set(self, s: Shapes) -> dict[str, float]:
        """Bytes the method keeps in host memory while it prunes a layer (a CPU's one memory: its device's too): the
        update's start and best round (``best_round``), float32 copies of the pruned MLP, and where ``X`` and ``Y``
        stream from host memory the rounds' token samples drawn from them."""
        if not self.uses_targets:
            return {}
        held = {"update's start and best round": 2 * (s.in_proj + 1) * s.d * s.n_keep * 4}
        samples = self.token_samples(s)
        return held | ({"update's token samples": samples} if s.streamed and samples else {})

    def token_samples(self, s: Shapes) -> float:
        """Bytes of the copies of ``X`` and ``Y`` rows an update draws for its rounds, held where ``X`` and ``Y`` are
        (none here)."""
        return 0.0


METHODS: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    METHODS[cls.name] = cls
    return cls


def parse_label(label: str) -> tuple[str, dict]:
    """``method`` or ``method/key=value,key=value`` (a composition such as ``spap/select=act_norm,allocation=error``,
    as grids name their cells) → the method's name and those hyperparameters."""
    method, _, spec = label.partition("/")
    hparams = {}
    for item in filter(None, spec.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ParameterError(f"bad method label {label!r}: expected method/key=value[,key=value]")
        hparams[key.strip()] = scalar(value)
    return method, hparams


def get_method(name: str, **hparams) -> Method:
    """The registered method ``name`` with ``hparams`` over its defaults; every value is checked. ``name`` may
    be a label (``parse_label``) whose settings ``hparams`` must not contradict."""
    if isinstance(name, str) and "/" in name:
        label = name
        name, given = parse_label(label)
        clash = sorted(k for k in given.keys() & hparams.keys() if given[k] != hparams[k])
        if clash:
            raise ParameterError(f"method label {label!r} sets {', '.join(clash)} otherwise than hparams "
                                 f"{ {k: hparams[k] for k in clash} }: give each setting once")
        hparams = {**given, **hparams}
    if not isinstance(name, str) or name not in METHODS:
        raise ParameterError(f"unknown method {name!r}: registered methods are {', '.join(sorted(METHODS))}")
    cls = METHODS[name]
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(hparams) - known
    parts = sorted(unknown & {"select", "allocation", "update"})
    if parts:
        raise ParameterError(f"method {name!r} takes no {' or '.join(parts)}: {cls.fixed_parts()}")
    if unknown:
        raise ParameterError(
            f"unknown hyperparameter(s) {sorted(unknown)} for method {name!r}; it takes {sorted(known)}"
        )
    return cls(**hparams)
