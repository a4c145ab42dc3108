"""Layer-by-layer replay of calibration data through a decoder.

Instead of running the whole model per layer, we capture what enters decoder layer 0 and the
keyword arguments every layer receives (masks, rotary embeddings: they depend on the batch shape,
not on the tokens), then call layers one at a time. Only one layer's activations are alive.
Every patch and hook is undone by a context manager, even when a step raises.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from spap_lib.numerics.linalg import check_finite


class _Stop(Exception):
    """Raised by the recorder to end a forward pass once it has what it needs."""


@contextmanager
def _recording(layers: nn.ModuleList, all_layers: bool):
    """Replace each layer's forward by a recorder that returns its input unchanged.

    With ``all_layers=False`` only layer 0 records, then stops the pass.
    """
    record: dict = {"kwargs": []}

    def make(i: int):
        def recorder(hidden_states, *args, **kwargs):
            if i == 0:
                record["hidden"] = hidden_states
            record["kwargs"].append({k: v for k, v in kwargs.items() if k != "past_key_values"})
            if not all_layers or i == len(layers) - 1:
                raise _Stop
            return hidden_states

        return recorder

    try:
        for i, layer in enumerate(layers):
            layer.forward = make(i)
        yield record
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)


def on_device(device):
    """The default ``store``: activations allocated on ``device``."""
    return lambda shape, dtype: torch.empty(shape, dtype=dtype, device=device)


@torch.no_grad()
def first_layer_inputs(model: nn.Module, layers: nn.ModuleList, windows: torch.Tensor, batch_size: int, device,
                       store=None):
    """Layer-0 inputs ``[n, seqlen, d]`` for token ``windows [n, seqlen]``, and per-layer kwargs.

    ``kwargs[b][i]`` are the keyword arguments of layer ``i`` for a batch of ``b`` windows (on the
    device: rotary tables and masks, small). The inputs are written batch by batch into
    ``store(shape, dtype)`` (default: a tensor on the device; an onloader's ``activations`` keeps them
    in host memory or a spill file).
    """
    hidden, kwargs = None, {}
    for start in range(0, windows.shape[0], batch_size):
        batch = windows[start:start + batch_size].to(device)
        want_all = batch.shape[0] not in kwargs
        with _recording(layers, all_layers=want_all) as rec:
            try:
                model(input_ids=batch, use_cache=False)
            except _Stop:
                pass
        h = rec.pop("hidden")
        if hidden is None:
            hidden = (store or on_device(device))((windows.shape[0], *h.shape[1:]), h.dtype)
        hidden[start:start + h.shape[0]] = h
        if want_all:
            kwargs[batch.shape[0]] = rec["kwargs"]
    return hidden, kwargs


@contextmanager
def returning(layers: nn.ModuleList, final: torch.Tensor):
    """Make the decoder layers a no-op whose last one returns ``final`` (outputs computed layer by layer
    elsewhere), so the model's own forward applies its final norm, head and any logit soft-capping."""
    def make(i: int):
        def passthrough(hidden_states, *args, **kwargs):
            return final.to(hidden_states.device) if i == len(layers) - 1 else hidden_states
        return passthrough

    try:
        for i, layer in enumerate(layers):
            layer.forward = make(i)
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)


@torch.no_grad()
def streamed_logits(model: nn.Module, onloader, windows: torch.Tensor, consume, spans=None) -> None:
    """The model's logits for every window ``[n, seqlen]``, computed one decoder layer at a time over
    all windows (``onloader``: where the weights wait); ``consume(i, s, logits)`` gets window ``i``'s
    ``[1, e − s, V]`` for each span ``(s, e)`` of positions in ``spans`` (default: the whole window).

    The same operations as ``model(window)`` in the same order, batch 1: equal results, with only one
    layer's weights and the windows' hidden states (in host memory) alive. Each span is one more call of the
    model's own forward (its final norm, head and any logit soft-capping) with ``logits_to_keep`` set to the
    span's positions: the decoder layers only hand back the window's final hidden states, so a span costs its
    own share of the head, and the logits alive are one span's, not a window's (docs/scale.md: Memory per layer).
    """
    layers, device = onloader.layers, onloader.device
    with onloader.base():
        hidden, kwargs = first_layer_inputs(model, layers, windows, 1, device, store=onloader.activations)
    for i in range(len(layers)):
        with onloader.layer(i) as layer:
            hidden = replay(layer, hidden, {b: kw[i] for b, kw in kwargs.items()},
                            Batching(1, device, onloader.activations))[0]
    spans = spans or [(0, windows.shape[1])]
    with onloader.base():
        for w in range(windows.shape[0]):
            with returning(layers, hidden[w:w + 1]):
                for s, e in spans:
                    keep = torch.arange(s, e, device=device) if (s, e) != (0, windows.shape[1]) else 0
                    consume(w, s, model(input_ids=windows[w:w + 1].to(device), use_cache=False,
                                        logits_to_keep=keep).logits)


def run_layer(layer: nn.Module, hidden: torch.Tensor, kwargs: dict) -> torch.Tensor:
    out = layer(hidden, **kwargs)
    return out[0] if isinstance(out, tuple) else out


class _Rows:
    """Rows written batch by batch into one tensor from ``store(shape, dtype)``, allocated at the first batch
    (when the width and dtype are known) for ``per_sample × samples`` rows: never a list of batches
    concatenated at the end, which holds everything twice."""

    def __init__(self, samples: int, store):
        self.samples, self.store, self.filled, self.rows = samples, store, 0, None

    def add(self, x: torch.Tensor, samples: int) -> None:
        x = x.reshape(-1, x.shape[-1]).detach()
        if self.rows is None:
            per = x.shape[0] // samples  # tokens per sample (every batch has the same sequence length)
            self.rows = (self.store or on_device(x.device))((per * self.samples, x.shape[-1]), x.dtype)
        self.rows[self.filled:self.filled + x.shape[0]] = x
        self.filled += x.shape[0]


@contextmanager
def capture_inputs(module: nn.Module, stop: bool = False):
    """Collect the first positional input of every call to ``module`` (flattened to tokens); with
    ``stop``, end the forward pass there (``_Stop``): what comes after ``module`` is not computed."""
    store: list[torch.Tensor] = []

    def hook(_module, args):
        x = args[0]
        store.append(x.reshape(-1, x.shape[-1]).detach())
        if stop:
            raise _Stop

    handle = module.register_forward_pre_hook(hook)
    try:
        yield store
    finally:
        handle.remove()


@dataclass(frozen=True)
class Batching:
    """How ``replay`` cuts and places its batches: ``size`` windows per batch; ``device`` where each runs (None:
    where ``hidden`` is; else each batch moves there: ``hidden`` may wait in host memory or a spill file);
    ``store(shape, dtype)`` allocates the outputs (None: where ``hidden`` is) and ``inputs(shape, dtype)`` the
    watched module's inputs (None: on the device; an onloader's ``calibration`` keeps them in host memory when the
    layer's weights are offloaded); with ``finite`` (what the outputs are, for the message) every output batch is
    checked for NaN/Inf."""
    size: int = 1
    device: torch.device | None = None
    store: Callable | None = None
    inputs: Callable | None = None
    finite: str | None = None


@torch.no_grad()
def replay(layer: nn.Module, hidden: torch.Tensor, kwargs: dict, batching: Batching | int,
           watch: nn.Module | None = None, *, outputs: bool = True, attention: nn.Module | None = None,
           reuse: torch.Tensor | None = None):
    """Run ``hidden [n, seqlen, d]`` through ``layer`` in batches (``batching``; an int: that many windows per
    batch, where ``hidden`` is).

    Returns the layer outputs and, if ``watch`` is given, the inputs seen by ``watch`` as
    ``[n·seqlen, d_in]`` (for us: the MLP inputs after the layer's norm), written batch by batch into
    ``batching.inputs``. ``outputs=False`` (with ``watch``): each batch stops at ``watch``, and the outputs are None
    (a pipeline that recomputes them through the pruned layer skips the dense MLP's work).

    ``attention`` (the layer's attention module, whose output the MLP does not change): with ``outputs=False``
    its outputs are kept, in ``batching.store``, and returned in place of the layer's; given those as ``reuse``
    (from a replay of the same ``hidden`` and batches), its forward is skipped, each batch reading its kept rows,
    and the layer's outputs overwrite them in place. A pruned layer's replay then costs its MLP and norms only.
    """
    b = batching if isinstance(batching, Batching) else Batching(batching)
    batch_size, device, store, inputs, finite = b.size, b.device, b.store, b.inputs, b.finite
    seen = None if watch is None else _Rows(hidden.shape[0], inputs)
    out = reuse  # filled batch by batch: no list of batches concatenated at the end (both alive at once)
    keep = attention is not None and reuse is None and not outputs
    rows = [0]  # the batch's first row, for the kept attention outputs
    with capture_inputs(watch, stop=not outputs) if watch is not None else nullcontext([]) as batches, \
            _attention_outputs(attention, keep, reuse, rows) as attended:
        for start in range(0, hidden.shape[0], batch_size):
            h = hidden[start:start + batch_size]
            rows[0] = start
            try:
                o = run_layer(layer, h if device is None else h.to(device), kwargs[h.shape[0]])
            except _Stop:
                o = attended.pop() if keep else None
            while batches:  # the watched module's inputs of this batch
                seen.add(batches.pop(0), h.shape[0])
            if o is None:
                continue
            if finite is not None:
                check_finite(o, finite)
            if out is None:
                out = (store or on_device(hidden.device))((hidden.shape[0], *o.shape[1:]), o.dtype)
            out[start:start + o.shape[0]] = o
    return out, None if seen is None else seen.rows


@contextmanager
def _attention_outputs(module: nn.Module | None, keep: bool, reuse: torch.Tensor | None, rows: list[int]):
    """``keep``: each call's output of ``module`` appended to the yielded list. ``reuse``: ``module``'s forward
    replaced by one returning the kept rows from ``rows[0]`` on (as many as the call's batch has), with the
    rest of the original's output tuple (the attention weights: None, never asked for)."""
    kept: list[torch.Tensor] = []
    if module is None or not (keep or reuse is not None):
        yield kept
        return
    if keep:
        handle = module.register_forward_hook(
            lambda _m, _a, out: kept.append(out[0] if isinstance(out, tuple) else out))
        try:
            yield kept
        finally:
            handle.remove()
        return

    def forward(hidden_states, *args, **kwargs):
        o = reuse[rows[0]:rows[0] + hidden_states.shape[0]].to(hidden_states.device)
        return o, None

    module.forward = forward
    try:
        yield kept
    finally:
        module.__dict__.pop("forward", None)
