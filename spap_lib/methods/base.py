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
from spap_lib.errors import option_name
from spap_lib.methods.parts.allocation import ALLOCATIONS
from spap_lib.model.adapters import MLP
from spap_lib.numerics.collective import gather_rows
from spap_lib.numerics.linalg import (
    PRECISIONS,
    check_finite,
    chunk_for,
    gram,
    gram_and_outputs,
    outputs,
    resolve_precision,
    sq_norm,
    token_energies,
    top_share,
)


def highest(score: torch.Tensor, n_keep: int) -> torch.Tensor:
    """The indices of the ``n_keep`` highest scores, sorted: the channels a score keeps."""
    return torch.sort(torch.topk(score, n_keep).indices).values


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
        return top_share(gather_rows(energies))  # the largest 1% of every rank's tokens

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


@dataclass(frozen=True)
class DensePass:
    """The pass over the dense model a composed method needs before its first layer is pruned
    (``Method.dense_pass``): what it measures and how it runs."""

    scores: bool  # it gives the method's channels (a score method without propagation): no layer loop follows
    channels: bool  # it measures every channel (``ChannelStats.of``), not only each block's angular distance
    curves: bool  # it takes every layer's error curve (``Method.error_curve``)
    share: float  # of the calibration windows it reads (``pipeline.sequential.allocation_inputs``)
    bf16: bool  # its replay's products in bf16 (``linalg.products``)


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
    # Whether channels are chosen by a score of the dense layer alone (no fit): without propagation,
    # one pass of dense statistics then serves every layer.
    scores_dense: ClassVar[bool] = False
    # Gram accumulation and solve precision; methods that solve declare it as a hyperparameter.
    precision = "float64"
    # Hyperparameters added with the earlier behaviour as their default: a result recorded before one of them
    # existed ran that default (``grid.ran_with``).
    introduced: ClassVar[tuple[str, ...]] = ()
    # The pipeline that runs the method, as the method declares it: "layers", the sequential pipeline (``prune``
    # on one MLP at a time, a channel sparsity plan, any offload, resumable layer by layer), or "model"
    # (``prune_model`` on the resident model, with a sparsity of the method's own definition). Callers dispatch on
    # it; the other differences are the hooks below (``offloads``, ``check_settings``, ``check_config``).
    pipeline: ClassVar[str] = "layers"

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
        """Channels to remove per layer, summing to ``total``, by the registered allocation (``stats``: dense
        ``ChannelStats``; ``scores``: every layer's ``allocation_scores``, where the allocation needs them)."""
        return ALLOCATIONS[self.allocation].split(self, stats, width, total, scores)

    @property
    def uniform_widths(self) -> bool:
        """Every layer keeps the same width: the allocation needs no dense pass (a stock-loadable checkpoint)."""
        return "dense_pass" not in ALLOCATIONS[self.allocation].needs

    def dense_pass(self, propagate: bool) -> DensePass | None:
        """The one question the pipeline asks before the first layer: which dense pass this composition needs,
        if any. A score method without propagation takes its scores from it (every window, the model's
        precision); an allocation that needs one takes it on ``allocation_sample`` at ``allocation_precision``."""
        needs = ALLOCATIONS[self.allocation].needs
        if self.scores_dense and not propagate:
            return DensePass(scores=True, channels=True, curves="curves" in needs, share=1.0, bf16=False)
        if "dense_pass" not in needs:
            return None
        return DensePass(scores=False, channels="channel_stats" in needs, curves="curves" in needs,
                         share=self.allocation_sample, bf16=self.allocation_precision == "bf16")

    def allocation_tokens(self, N: int) -> int:
        """Of ``N`` calibration tokens, about how many the dense pass that decides the widths reads
        (``allocation_sample``; whole windows in the pipeline, ``allocation_inputs``)."""
        return max(1, round(N * self.allocation_sample))

    def prepare(self, adapter) -> None:
        """Check (and adapt) the architecture before any work is done; raise if it cannot be pruned."""
        self.check_config(adapter.model.config)

    def check_config(self, config) -> None:
        """Refuse, from the config alone, an architecture the method cannot prune (the plan has no model)."""

    @property
    def offloads(self) -> tuple[str, ...]:
        """Where the weights may wait between layers while the method runs (``model.offload``)."""
        return ("none", "cpu", "disk") if self.pipeline == "layers" else ("none",)

    @property
    def resumable(self) -> bool:
        """Whether a run saves its finished layers and resumes after them (``pipeline.resume``)."""
        return self.pipeline == "layers"

    def check_settings(self, *, round_to: int | None, propagate: bool | None, resume_dir) -> None:
        """Refuse run settings that the method's pipeline does not read (None: not given): a method that is not
        ``resumable`` saves no finished layers, so a ``resume_dir`` would be ignored."""
        if resume_dir is not None and not self.resumable:
            raise ParameterError(f"method {self.name!r} does not take {option_name('resume_dir')}: it saves no "
                                 f"finished layers to resume after (pipeline {self.pipeline!r}); drop "
                                 f"{option_name('resume_dir')} (a run cut short starts over)")

    def prune(self, problem: LayerProblem) -> PruneResult:
        raise NotImplementedError

    def prune_model(self, loaded, calib, sparsity: float, *, batch_size: int, progress: bool) -> dict:
        """Methods of the "model" ``pipeline``: transform ``loaded.model`` in place; return ``seconds``, per-layer
        diagnostics (``layers``), the ``precision`` it computed in, its ``sparsity``'s ``definition`` and what it
        is ``counted_over``, and ``plan``: ``{plan_key: data}`` of its checkpoint format (``model.formats``), what
        ``spap_lib.load`` re-applies."""
        raise NotImplementedError

    def hparams(self) -> dict:
        return dataclasses.asdict(self)

    def effective_hparams(self) -> dict:
        """The hyperparameters that decide this instance's result: ``hparams()`` less those that its other
        settings make inert. A grid row recorded before an inert option existed is still current."""
        return self.hparams()


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
