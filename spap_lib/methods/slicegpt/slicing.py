"""SliceGPT (Ashkboos et al., ICLR 2024): rotate the residual stream by PCA and slice it.

A baseline of the paper's Table 1 that prunes differently from every other method here: instead of
MLP channels it removes dimensions of the residual stream ("embedding dimension") of every block,
so attention and MLP shrink together. Three steps:

1. **Fuse the norms** (``fuse_norms``): every norm's scale (and OPT's LayerNorm bias and mean
   subtraction) moves into the adjacent Linear layers, leaving a weightless RMS norm (``RMSN``), so
   that an orthogonal ``Q`` commutes with it: ``RMSN(x Q) = RMSN(x) Q``. The logits do not change.
2. **Rotate** each block's input, attention output and MLP output by the eigenvectors ``Q`` of the
   Gram matrix ``X Xᵀ`` of the calibration signals there (float64 PCA, largest variance first),
   sequentially, each block on the outputs of the already sliced ones.
3. **Slice**: keep the first ``k`` rotated dimensions. The residual connections then need the
   shortcut matrices ``Q_lᵀ Q_{l+1}`` (sliced), kept per block (``SlicedBlock``).

Deviations from the official code (microsoft/TransformerCompression), written from it, not copied:
dimensions ``k = ⌊(1 − s)·d⌋`` rounded down to a multiple of ``round_to`` (its ``--round-interval``,
default 8); the final orientation is the PCA basis (its default is a random rotation of the kept
block, which leaves perplexity unchanged); the head is rotated but not sliced (its default too).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from spap_lib.checks import ParameterError
from spap_lib.model.formats import CheckpointFormat, register_format


class RMSN(nn.Module):
    """``x / sqrt(Σ x² / d + ε)`` with ``d`` the model's *full* hidden size: on a sliced stream the
    dropped dimensions carried little variance, so dividing by the full size keeps the scale."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.dim, self.eps = dim, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x  # half precision: sums in float32
        return (y * torch.rsqrt(y.pow(2).sum(-1, keepdim=True) / self.dim + self.eps)).to(x.dtype)


@dataclass(frozen=True)
class Layout:
    """Where a pre-norm decoder's pieces live (names relative to the block or the model)."""

    norm1: str
    norm2: str
    attn: str
    attn_in: tuple[str, ...]   # under ``attn``
    attn_out: str              # under ``attn``
    mlp_in: tuple[str, ...]    # under ``mlp_owner``
    mlp_out: str
    mlp_owner: str             # "" = the block itself (OPT)
    embeddings: tuple[str, ...]
    final_norm: str
    layers: str
    centred: bool              # LayerNorm (mean subtraction baked into the writers of the stream)


LAYOUTS = {
    "llama": Layout("input_layernorm", "post_attention_layernorm", "self_attn", ("q_proj", "k_proj", "v_proj"),
                    "o_proj", ("gate_proj", "up_proj"), "down_proj", "mlp", ("model.embed_tokens",), "model.norm",
                    "model.layers", centred=False),
    "opt": Layout("self_attn_layer_norm", "final_layer_norm", "self_attn", ("q_proj", "k_proj", "v_proj"),
                  "out_proj", ("fc1",), "fc2", "", ("model.decoder.embed_tokens", "model.decoder.embed_positions"),
                  "model.decoder.final_layer_norm", "model.decoder.layers", centred=True),
}
LAYOUTS["qwen2"] = LAYOUTS["mistral"] = LAYOUTS["llama"]
REFUSED = {
    "gemma": "Gemma scales the embeddings and its RMSNorm multiplies by (1 + weight)",
    "gemma2": "Gemma-2 normalises the attention and MLP outputs (post-norms) before the residual add",
    "gemma3_text": "Gemma-3 normalises the attention and MLP outputs (post-norms) before the residual add",
    "qwen3": "not implemented for Qwen3 (its q/k norms are fine; nothing here tests it yet)",
}


def layout_of(model: nn.Module) -> Layout:
    """The model's layout, or a refusal naming the reason, before any work."""
    config = model.config
    kind = config.model_type
    if kind in REFUSED:
        raise ParameterError(f"slicegpt cannot prune {kind!r}: {REFUSED[kind]}, so a rotation of the residual "
                             f"stream does not commute with the block. Use an MLP-channel method (spap, fasp).")
    if kind not in LAYOUTS:
        raise ParameterError(f"slicegpt supports {', '.join(sorted(LAYOUTS))}, not {kind!r}")
    if kind == "opt" and (not config.do_layer_norm_before or config.word_embed_proj_dim != config.hidden_size):
        raise ParameterError("slicegpt needs a pre-norm OPT without embedding projections (opt-350m has both "
                             "post-norms and project_in/out); use opt-125m, opt-1.3b or larger")
    return LAYOUTS[kind]


def _get(root: nn.Module, path: str) -> nn.Module:
    for part in filter(None, path.split(".")):
        root = getattr(root, part)
    return root


def _set(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(_get(root, parent), name, module)


class SlicedBlock(nn.Module):
    """A pre-norm decoder block whose residual stream is rotated and sliced:
    ``h = x Q_attn + attn(norm1(x))``, ``y = h Q_mlp + mlp(norm2(h))``; ``Q_attn [k_in, k_mid]`` and
    ``Q_mlp [k_mid, k_out]`` are the shortcut matrices (the identity before any slicing)."""

    def __init__(self, block: nn.Module, layout: Layout, dim: int, dtype: torch.dtype, device):
        super().__init__()
        self.block, self.layout = block, layout
        eye = torch.eye(dim, dtype=dtype, device=device)
        self.attn_shortcut = nn.Parameter(eye.clone(), requires_grad=False)
        self.mlp_shortcut = nn.Parameter(eye.clone(), requires_grad=False)

    def __getattr__(self, name: str):
        """Everything else is the wrapped block's (``mlp``, ``fc1``, ``self_attn``...), so the MLP adapters
        and parameter counts see a sliced block as the block it wraps."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("block"), name)

    def attn(self) -> nn.Module:
        return getattr(self.block, self.layout.attn)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout.mlp_owner:
            return getattr(self.block, self.layout.mlp_owner)(x)
        b = self.block  # OPT: the MLP's Linear layers sit on the block
        return b.fc2(b.activation_fn(b.fc1(x)))

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        h = self.attn()(hidden_states=getattr(self.block, self.layout.norm1)(hidden_states), **kwargs)[0]
        h = hidden_states @ self.attn_shortcut + h
        return h @ self.mlp_shortcut + self._mlp(getattr(self.block, self.layout.norm2)(h))


def _scale_inputs(linears: list[nn.Linear], norm: nn.Module) -> None:
    """``W ← W diag(g)`` and ``b ← b + W β`` for a norm ``g·x̂ + β`` feeding ``linears`` (float64)."""
    g = norm.weight.double()
    beta = getattr(norm, "bias", None)
    for lin in linears:
        W = lin.weight.double()
        if beta is not None:
            b = (lin.bias.double() if lin.bias is not None else W.new_zeros(W.shape[0])) + W @ beta.double()
            lin.bias = nn.Parameter(b.to(lin.weight.dtype), requires_grad=False)
        lin.weight.data = (W * g).to(lin.weight.dtype)


def _centre_outputs(lin: nn.Linear) -> None:
    """Subtract the mean over the output dimension from ``lin``'s rows and bias: what it writes into
    the residual stream has zero mean, so the next LayerNorm's mean subtraction is a no-op."""
    W = lin.weight.double()
    lin.weight.data = (W - W.mean(0, keepdim=True)).to(lin.weight.dtype)
    if lin.bias is not None:
        b = lin.bias.double()
        lin.bias.data = (b - b.mean()).to(lin.bias.dtype)


@torch.no_grad()
def fuse_norms(model: nn.Module) -> Layout:
    """Step 1 in place: the same logits, every norm a weightless ``RMSN``, every block a ``SlicedBlock``
    with identity shortcuts; the head untied from the embeddings (it absorbs the final norm's scale)."""
    layout = layout_of(model)
    config = model.config
    d = config.hidden_size
    eps = getattr(config, "rms_norm_eps", None) or getattr(config, "layer_norm_eps", 1e-5)
    head = model.lm_head
    if head.weight is _get(model, layout.embeddings[0]).weight:  # tied: the head gets its own copy
        head.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=False)
    config.tie_word_embeddings = False
    if layout.centred:
        for path in layout.embeddings:
            E = _get(model, path)
            W = E.weight.double()
            E.weight.data = (W - W.mean(-1, keepdim=True)).to(E.weight.dtype)
    layers = _get(model, layout.layers)
    for i, block in enumerate(layers):
        attn = getattr(block, layout.attn)
        owner = getattr(block, layout.mlp_owner) if layout.mlp_owner else block
        _scale_inputs([getattr(attn, n) for n in layout.attn_in], getattr(block, layout.norm1))
        _scale_inputs([getattr(owner, n) for n in layout.mlp_in], getattr(block, layout.norm2))
        if layout.centred:
            _centre_outputs(getattr(attn, layout.attn_out))
            _centre_outputs(getattr(owner, layout.mlp_out))
        setattr(block, layout.norm1, RMSN(d, eps))
        setattr(block, layout.norm2, RMSN(d, eps))
        p = next(block.parameters())
        layers[i] = SlicedBlock(block, layout, d, p.dtype, p.device)
    final = _get(model, layout.final_norm)
    if getattr(final, "bias", None) is not None and head.bias is None:  # OPT: the head gets a bias
        new = nn.Linear(head.in_features, head.out_features, bias=True, device=head.weight.device,
                        dtype=head.weight.dtype)
        new.weight.data, new.bias.data = head.weight.data, torch.zeros_like(new.bias)
        model.lm_head = head = new
    _scale_inputs([head], final)
    _set(model, layout.final_norm, RMSN(d, eps))
    return layout


def pca(X: torch.Tensor) -> torch.Tensor:
    """Eigenvectors of ``Σ xᵀx`` over the rows of ``X [..., d]`` in float64, largest eigenvalue first."""
    X = X.reshape(-1, X.shape[-1])
    H = torch.zeros(X.shape[1], X.shape[1], dtype=torch.float64, device=X.device)
    for x in X.split(8192):
        x = x.double()
        H += x.T @ x
    values, vectors = torch.linalg.eigh(H)
    return vectors[:, torch.argsort(values, descending=True)]


def _project(X: torch.Tensor, Qk: torch.Tensor) -> torch.Tensor:
    """``X Q_k`` in float64, a window at a time (no float64 copy of all the activations), in X's dtype."""
    out = X.new_empty(*X.shape[:-1], Qk.shape[1])
    for s in range(X.shape[0]):
        out[s] = (X[s].double() @ Qk).to(X.dtype)
    return out


def sliced_dim(hidden: int, sparsity: float, round_to: int) -> int:
    """``⌊(1 − s)·d⌋`` rounded down to a multiple of ``round_to`` (at least ``round_to``)."""
    k = int((1 - sparsity) * hidden)
    return max(round_to, k - k % round_to)


def _rotate_in(linears, Q: torch.Tensor, k: int) -> None:
    """Inputs of ``linears`` in the rotated basis, first ``k`` dimensions: ``W ← (W Q)[:, :k]``."""
    for lin in linears:
        lin.weight.data = (lin.weight.double() @ Q[:, :k]).to(lin.weight.dtype).contiguous()
        lin.in_features = k


def _rotate_out(lin: nn.Linear, Q: torch.Tensor, k: int) -> None:
    """Outputs of ``lin`` in the rotated basis, first ``k`` dimensions: ``W ← (Qᵀ W)[:k]``, ``b ← (Qᵀ b)[:k]``."""
    lin.weight.data = (Q[:, :k].T @ lin.weight.double()).to(lin.weight.dtype).contiguous()
    if lin.bias is not None:
        lin.bias.data = (Q[:, :k].T @ lin.bias.double()).to(lin.bias.dtype).contiguous()
    lin.out_features = k


@torch.no_grad()
def rotate_and_slice(model: nn.Module, layout: Layout, windows: torch.Tensor, k: int, *, batch_size: int = 1,
                     device=None) -> list[dict]:
    """Steps 2-3 on a ``fuse_norms``'d model, block after block on the sliced blocks' outputs: returns
    every block's dimensions (input, between attention and MLP, output)."""
    from spap_lib.model.capture import first_layer_inputs, replay

    device = device or next(model.parameters()).device
    layers = _get(model, layout.layers)
    d = model.config.hidden_size
    X, kwargs = first_layer_inputs(model, layers, windows, batch_size, device)
    Q = pca(X)
    for path in layout.embeddings:
        E = _get(model, path)
        E.weight.data = (E.weight.double() @ Q[:, :k]).to(E.weight.dtype).contiguous()
        E.embedding_dim = k
    X = _project(X, Q[:, :k])
    dims = []
    for i, blk in enumerate(layers):
        k_out = k if i < len(layers) - 1 else d  # the head reads the full stream (rotated, not sliced)
        attn = blk.attn()
        owner = getattr(blk.block, layout.mlp_owner) if layout.mlp_owner else blk.block
        kw = {b: per_layer[i] for b, per_layer in kwargs.items()}
        # Attention reads the sliced stream; its residual goes back to the full basis for now.
        shortcut = Q[:, :k].T
        _rotate_in([getattr(attn, n) for n in layout.attn_in], Q, k)
        blk.attn_shortcut.data = shortcut.to(blk.attn_shortcut.dtype)
        # PCA of the stream between attention and MLP (the input of the second norm).
        _, M = replay(blk, X, kw, batch_size, watch=getattr(blk.block, layout.norm2))
        Q = pca(M)
        del M
        blk.attn_shortcut.data = (shortcut @ Q[:, :k]).to(blk.attn_shortcut.dtype)
        _rotate_out(getattr(attn, layout.attn_out), Q, k)
        shortcut = Q[:, :k].T
        _rotate_in([getattr(owner, n) for n in layout.mlp_in], Q, k)
        blk.mlp_shortcut.data = shortcut.to(blk.mlp_shortcut.dtype)
        # PCA of the block's output (full basis), which becomes the next block's rotation.
        Y, _ = replay(blk, X, kw, batch_size)
        Q = pca(Y)
        blk.mlp_shortcut.data = (shortcut @ Q[:, :k_out]).to(blk.mlp_shortcut.dtype)
        _rotate_out(getattr(owner, layout.mlp_out), Q, k_out)
        X = _project(Y, Q[:, :k_out])
        del Y
        dims.append({"in": k, "mid": k, "out": k_out})
    _rotate_in([model.lm_head], Q, d)
    return dims


# -- the sliced checkpoint: the plan stored as data, re-applied on load --------------------------------
SLICED_TYPE = "spap_sliced"  # config.json's model_type: stock transformers refuses it (nothing loads wrong)


def plan_of(model: nn.Module, layout: Layout, dims: list[dict]) -> dict:
    """What ``load_sliced`` needs to rebuild the shapes: the base architecture and every dimension."""
    return {"base_model_type": model.config.model_type, "hidden_size": model.config.hidden_size,
            "embedding_dim": _get(model, layout.embeddings[0]).weight.shape[1], "dims": dims,
            "head_bias": model.lm_head.bias is not None}


def mark_sliced(folder, plan: dict) -> None:
    """Rewrite a saved ``config.json``: ``model_type`` becomes ``spap_sliced`` (stock ``from_pretrained``
    then refuses it instead of loading random weights into stock shapes) and the plan goes alongside."""
    import json
    from pathlib import Path

    from spap_lib.files import write_json_atomic

    path = Path(folder) / "config.json"
    config = json.loads(path.read_text())
    write_json_atomic(path, {**config, "model_type": SLICED_TYPE, "spap_slicing": plan})


def sliced_config(config_dict: dict):
    """The base architecture's config for a ``spap_sliced`` config.json (plan kept as ``spap_slicing``)."""
    from transformers import AutoConfig

    plan = config_dict["spap_slicing"]
    rest = {k: v for k, v in config_dict.items() if k not in ("model_type",)}
    return AutoConfig.for_model(plan["base_model_type"], **rest)


@torch.no_grad()
def shape_like(model: nn.Module, plan: dict) -> nn.Module:
    """Give a freshly built base model the sliced structure of ``plan`` (norms fused to ``RMSN``, blocks
    wrapped with shortcuts, every Linear at its sliced shape), ready for ``load_state_dict``."""
    layout = fuse_norms(model)
    eye = torch.eye(plan["hidden_size"], dtype=torch.float64, device=next(model.parameters()).device)
    for path in layout.embeddings:
        E = _get(model, path)
        E.weight.data = E.weight.data[:, :plan["embedding_dim"]].contiguous()
        E.embedding_dim = plan["embedding_dim"]
    for blk, dims in zip(_get(model, layout.layers), plan["dims"]):
        attn = blk.attn()
        owner = getattr(blk.block, layout.mlp_owner) if layout.mlp_owner else blk.block
        _rotate_in([getattr(attn, n) for n in layout.attn_in], eye, dims["in"])
        _rotate_out(getattr(attn, layout.attn_out), eye, dims["mid"])
        _rotate_in([getattr(owner, n) for n in layout.mlp_in], eye, dims["mid"])
        _rotate_out(getattr(owner, layout.mlp_out), eye, dims["out"])
        blk.attn_shortcut.data = blk.attn_shortcut.data[:dims["in"], :dims["mid"]].contiguous()
        blk.mlp_shortcut.data = blk.mlp_shortcut.data[:dims["mid"], :dims["out"]].contiguous()
    return model


def plan_for(config, sparsity: float, round_to: int = 8) -> dict:
    """The slicing plan of ``sparsity`` from the config alone: the shapes SliceGPT gives (what a speed
    profile needs; the weights come from the data)."""
    from types import SimpleNamespace

    layout = layout_of(SimpleNamespace(config=config))
    d, layers = config.hidden_size, config.num_hidden_layers
    k = sliced_dim(d, sparsity, round_to)
    return {"base_model_type": config.model_type, "hidden_size": d, "embedding_dim": k,
            "dims": [{"in": k, "mid": k, "out": k if i < layers - 1 else d} for i in range(layers)],
            "head_bias": layout.centred}


def load_sliced(path, dtype: torch.dtype) -> nn.Module:
    """Rebuild a sliced checkpoint: base model from the config, ``shape_like`` its plan, strict load."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    config_dict = json.loads((Path(path) / "config.json").read_text())
    config = sliced_config(config_dict)
    model = shape_like(AutoModelForCausalLM.from_config(config, dtype=dtype), config_dict["spap_slicing"])
    state = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        state.update(load_file(file))
    model.load_state_dict(state, strict=True)
    return model.eval()


# Sliced checkpoints load through spap (``spap_lib.load``): registered here, so loading names no method.
SLICED_FORMAT = register_format(CheckpointFormat(
    "spap_slicing", "SliceGPT checkpoint (shortcut matrices between blocks)", load_sliced, read_config=sliced_config,
    resident_only=True, checks_own_shapes=True, plan_key="slicing", method="slicegpt", mark=mark_sliced,
    shape=shape_like, base_model_type=lambda config: (config.get("spap_slicing") or {}).get("base_model_type"),
    summary="every block's residual stream rotated and sliced (SliceGPT)"))
