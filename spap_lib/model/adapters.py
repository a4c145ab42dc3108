"""Architecture adapters: the only place that knows where an MLP lives in a model.

An adapter turns a decoder layer's MLP into an ``MLP`` (plain tensors + the activation) that the
methods work on, and writes a pruned ``MLP`` back by physically replacing the Linear modules.
Adding an architecture means adding one small class and listing its ``model_type`` values.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from spap_lib.errors import ParameterError, SourceError


@dataclass
class MLP:
    """One MLP block as tensors.

    ``W_in`` holds the input projections, each ``[n, d]`` (OPT: ``[fc1]``; GLU: ``[gate, up]``),
    ``W_out`` is the output projection ``[d, n]`` (OPT ``fc2``, GLU ``down_proj``). Channel ``j`` is
    row ``j`` of every input projection and column ``j`` of the output projection.
    """

    W_in: list[torch.Tensor]
    b_in: list[torch.Tensor | None]
    W_out: torch.Tensor
    b_out: torch.Tensor | None
    act: Callable[[torch.Tensor], torch.Tensor]
    glu: bool

    @property
    def width(self) -> int:
        return self.W_out.shape[1]

    def hidden(self, X: torch.Tensor) -> torch.Tensor:
        """Intermediate activations Z (the output projection's input) for MLP inputs X [N, d]. Without gradients at
        most two ``[N, n]`` tensors live at a time (the activation, then the up projection multiplied in place):
        the passes over the calibration tokens hold a chunk's ``Z`` at a 70B layer's n = 28,672, not four."""
        if not self.glu:
            return self.act(nn.functional.linear(X, self.W_in[0], self.b_in[0]))
        gate = self.act(nn.functional.linear(X, self.W_in[0], self.b_in[0]))
        up = nn.functional.linear(X, self.W_in[1], self.b_in[1])
        if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
            return gate * up  # autograd keeps both factors for the backward pass
        return up.mul_(gate)  # the same products (multiplication commutes exactly)

    def __call__(self, X: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(self.hidden(X), self.W_out, self.b_out)

    def select(self, keep: torch.Tensor) -> "MLP":
        """The MLP restricted to channels ``keep`` (weights copied, nothing refitted)."""
        return MLP(
            W_in=[W.detach()[keep].clone() for W in self.W_in],
            b_in=[None if b is None else b.detach()[keep].clone() for b in self.b_in],
            W_out=self.W_out.detach()[:, keep].clone(),
            b_out=None if self.b_out is None else self.b_out.detach().clone(),
            act=self.act,
            glu=self.glu,
        )

    def out_augmented(self) -> torch.Tensor:
        """``[W_out | b_out]``: the output projection as one least-squares unknown (OPT's fc2 bias is one
        more column, against a constant row of ones in Z)."""
        return torch.cat([self.W_out, self.b_out[:, None]], 1) if self.b_out is not None else self.W_out

    def set_out_augmented(self, W: torch.Tensor) -> None:
        """Write ``[W_out | b_out]`` (an augmented least-squares solution) into the output projection."""
        if self.b_out is not None:
            self.W_out, self.b_out = W[:, :-1].float().contiguous(), W[:, -1].float().contiguous()
        else:
            self.W_out = W.float().contiguous()

    def clone(self, device=None) -> "MLP":
        """A copy, on ``device`` (default: where this one is)."""
        return self.to(self.W_out.device if device is None else device, copy=True)

    def to(self, device, copy: bool = False) -> "MLP":
        """This MLP's tensors on ``device`` (copied only where they move, unless ``copy``)."""
        def move(t):
            return None if t is None else t.detach().to(device, copy=copy)

        return MLP([move(W) for W in self.W_in], [move(b) for b in self.b_in], move(self.W_out), move(self.b_out),
                   self.act, self.glu)


def _new_linear(W: torch.Tensor, b: torch.Tensor | None, like: nn.Linear) -> nn.Linear:
    lin = nn.Linear(W.shape[1], W.shape[0], bias=b is not None, device=W.device, dtype=like.weight.dtype)
    with torch.no_grad():
        lin.weight.copy_(W)
        if b is not None:
            lin.bias.copy_(b)
    return lin


# What a prune's sparsity counts: the parameters ``Adapter.decoder_params`` sums.
COUNTED_OVER = "parameters inside decoder layers (attention, MLP, norms); not embeddings, final norm or LM head"


class Adapter:
    """Base class. Subclasses name the modules; shrinking and accounting are shared."""

    model_types: tuple[str, ...] = ()
    width_field: str = "intermediate_size"  # config field holding the MLP width
    in_names: tuple[str, ...] = ()
    out_name: str = ""
    # The layer's attention module, whose output (a tuple led by the attention output, as every transformers
    # decoder layer unpacks it) no MLP change alters: replaying a pruned layer reuses it (``capture.replay``).
    # "" where a layer's attention is not one such module: the replay recomputes it.
    attention_name: str = "self_attn"

    def __init__(self, model: nn.Module):
        self.model = model

    # -- where things are -------------------------------------------------------------------
    def layers(self) -> nn.ModuleList:
        raise NotImplementedError

    def mlp_owner(self, layer: nn.Module) -> nn.Module:
        """The module that holds the MLP's Linear layers as attributes."""
        raise NotImplementedError

    def mlp_input_module(self, layer: nn.Module) -> nn.Module:
        """A module whose first positional input is the MLP input X (after the norm)."""
        return getattr(self.mlp_owner(layer), self.in_names[0])

    def attention_module(self, layer: nn.Module) -> nn.Module | None:
        return getattr(layer, self.attention_name) if self.attention_name else None

    def activation(self, layer: nn.Module) -> Callable:
        raise NotImplementedError

    # -- tensors in and out -----------------------------------------------------------------
    def get_mlp(self, layer: nn.Module) -> MLP:
        """The layer's MLP in float32. Float32 weights are the module's own tensors, not copies (docs/scale.md: the
        1.5B host-memory target): nothing writes to a dense MLP (``MLP.select`` copies what a method changes) and
        ``set_mlp`` replaces the modules rather than writing into them."""
        owner = self.mlp_owner(layer)
        ins = [getattr(owner, n) for n in self.in_names]
        out = getattr(owner, self.out_name)
        return MLP(
            W_in=[m.weight.detach().float() for m in ins],
            b_in=[None if m.bias is None else m.bias.detach().float() for m in ins],
            W_out=out.weight.detach().float(),
            b_out=None if out.bias is None else out.bias.detach().float(),
            act=self.activation(layer),
            glu=len(self.in_names) == 2,
        )

    def set_mlp(self, layer: nn.Module, mlp: MLP) -> None:
        """Replace the layer's Linear modules by ones of the (possibly smaller) width of ``mlp``."""
        owner = self.mlp_owner(layer)
        # With Llama's config.mlp_bias every projection must carry a bias for stock loading.
        all_bias = bool(getattr(self.model.config, "mlp_bias", False))
        for name, W, b in zip(self.in_names, mlp.W_in, mlp.b_in):
            if b is None and all_bias:
                b = W.new_zeros(W.shape[0])
            setattr(owner, name, _new_linear(W, b, getattr(owner, name)))
        b_out = mlp.b_out if mlp.b_out is not None or not all_bias else mlp.W_out.new_zeros(mlp.W_out.shape[0])
        setattr(owner, self.out_name, _new_linear(mlp.W_out, b_out, getattr(owner, self.out_name)))

    def width(self, layer: nn.Module) -> int:
        return getattr(self.mlp_owner(layer), self.out_name).in_features

    def set_config_width(self, widths: int | list[int]) -> None:
        """Record the MLP width(s). Uniform widths keep the config stock; per-layer widths are stored
        as ``spap_mlp_widths`` (with the largest as the nominal width) for ``spap_lib.load``."""
        widths = [int(widths)] if isinstance(widths, int) else [int(w) for w in widths]
        setattr(self.model.config, self.width_field, max(widths))
        if len(set(widths)) > 1:
            self.model.config.spap_mlp_widths = widths
        elif hasattr(self.model.config, "spap_mlp_widths"):
            del self.model.config.spap_mlp_widths

    def keep_channels(self, kept: list[list[int]]) -> None:
        """Re-apply a pruning's shapes as data (``spap_plan.json``'s ``kept_channels``): every layer keeps
        the listed dense channels, weights as they are (nothing refitted: what profiling needs)."""
        layers = self.layers()
        if len(kept) != len(layers):
            raise ParameterError(f"kept_channels lists {len(kept)} layers, the model has {len(layers)}")
        for layer, keep in zip(layers, kept):
            mlp = self.get_mlp(layer)
            self.set_mlp(layer, mlp.select(torch.tensor(keep, dtype=torch.long, device=mlp.W_out.device)))
        self.set_config_width([len(k) for k in kept])

    def resize(self, layer: nn.Module, width: int) -> None:
        """Give a layer's MLP an (uninitialised) width, so a checkpoint of that shape can be loaded."""
        mlp = self.get_mlp(layer)
        self.set_mlp(layer, mlp.select(torch.arange(width)))

    # -- output bias (FLAP's compensation) ----------------------------------------------------
    def has_out_bias(self) -> bool:
        return getattr(self.mlp_owner(self.layers()[0]), self.out_name).bias is not None

    def can_add_out_bias(self) -> bool:
        """Whether stock transformers can load an MLP output bias this model does not have yet
        (Llama's ``config.mlp_bias``; a checkpoint with an unexpected bias would load without it)."""
        return hasattr(self.model.config, "mlp_bias")

    def enable_out_bias(self) -> None:
        if not self.can_add_out_bias():
            raise ParameterError(f"{self.model.config.model_type!r} has no MLP output bias slot in stock transformers")
        self.model.config.mlp_bias = True

    # -- parameter accounting ---------------------------------------------------------------
    def params_per_channel(self, layer: nn.Module) -> int:
        """Parameters removed with one channel: a row (+bias entry) of every input projection and
        a column of the output projection. The output bias (OPT fc2) stays."""
        owner = self.mlp_owner(layer)
        n = sum(getattr(owner, m).in_features + (getattr(owner, m).bias is not None) for m in self.in_names)
        return n + getattr(owner, self.out_name).out_features

    def decoder_params(self) -> int:
        return sum(p.numel() for p in self.layers().parameters())

    def mlp_params(self) -> int:
        """Parameters of the MLP Linear modules (weights and biases) over all decoder layers."""
        total = 0
        for layer in self.layers():
            owner = self.mlp_owner(layer)
            for name in (*self.in_names, self.out_name):
                total += sum(p.numel() for p in getattr(owner, name).parameters())
        return total


class GLUAdapter(Adapter):
    """gate/up/down MLPs: ``down(act(gate(x)) * up(x))`` (SwiGLU, GeGLU)."""

    model_types = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text")
    in_names = ("gate_proj", "up_proj")
    out_name = "down_proj"

    def layers(self):
        return self.model.model.layers

    def mlp_owner(self, layer):
        return layer.mlp

    def activation(self, layer):
        return layer.mlp.act_fn


class OPTAdapter(Adapter):
    """OPT: ``fc2(relu(fc1(x)))`` with biases; width in ``config.ffn_dim``."""

    model_types = ("opt",)
    width_field = "ffn_dim"
    in_names = ("fc1",)
    out_name = "fc2"

    def layers(self):
        return self.model.model.decoder.layers

    def mlp_owner(self, layer):
        return layer

    def activation(self, layer):
        return layer.activation_fn


ADAPTERS: tuple[type[Adapter], ...] = (GLUAdapter, OPTAdapter)


def supported_model_types() -> list[str]:
    return sorted(t for a in ADAPTERS for t in a.model_types)


def get_adapter(model: nn.Module) -> Adapter:
    model_type = getattr(model.config, "model_type", None)
    for cls in ADAPTERS:
        if model_type in cls.model_types:
            return cls(model)
    raise SourceError(
        f"unsupported architecture {model_type!r}: spap supports {', '.join(supported_model_types())}. "
        "Add an Adapter subclass in spap_lib/model/adapters.py for a new one."
    )
