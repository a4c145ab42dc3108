"""Loading a resolved model (``sources.resolve``) with device and dtype, resident or offloaded.

``load`` returns a ``Loaded``: the model, its tokenizer, its adapter and where its weights wait
(``offload``). Checkpoints with per-layer MLP widths are loaded by ``load_nonuniform``; every local
folder's tensors are checked against its config before any weight is read (``check_source_weights``).
"""
from __future__ import annotations

import copy
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from spap_lib.errors import ParameterError, SourceError, option
from spap_lib.model import converted
from spap_lib.model.adapters import Adapter, get_adapter, supported_model_types
from spap_lib.model.dtypes import pick_dtype
from spap_lib.model.formats import CheckpointFormat, format_of, register_format
from spap_lib.model.gguf_tokenizer import with_own_pre_tokenizer
from spap_lib.model.offload import DiskOffload, HostOffload, Onloader, check_offload, load_base
from spap_lib.model.sources import (
    ModelSource,
    check_weights,
    locate,
    readable,
    stored_shapes,
)
from spap_lib.model.stores import GGUFStore, SafetensorsStore


def load_saved(path: str | Path, dtype: torch.dtype) -> tuple[torch.nn.Module, str]:
    """A saved checkpoint the way users load it, and how: ``transformers`` for a stock layout, else
    ``spap_lib.load`` through its registered format."""
    from transformers import AutoModelForCausalLM

    fmt = format_of(json.loads((Path(path) / "config.json").read_text()))
    if fmt is not None:
        return fmt.load(path, dtype), "spap_lib.load"
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=False), "transformers"


def resolve(name: str) -> ModelSource:
    """The model ``name`` names (an alias, a hub id, a directory or a .gguf file: ``sources.locate``), and for a local
    folder its tensors checked against its config before anything is loaded (``check_source_weights``)."""
    source = locate(name)
    if source.kind == "dir":
        check_source_weights(source)
    return source


def check_source_weights(source: ModelSource) -> None:
    """A local folder's tensors against its config, from the file headers (``sources``): a missing,
    unexpected or misshapen tensor, a truncated file or an absent shard is refused before any load."""
    fmt = format_of(json.loads((Path(source.path) / "config.json").read_text()))
    if fmt is not None and fmt.checks_own_shapes:
        stored_shapes(source.path)  # complete, readable files; the format's loader then loads strictly
        return
    check_weights(source.path, _skeleton(source, torch.float32))


def _converted(source: ModelSource) -> Path | None:
    """The cache folder of a GGUF source converted before (``model.converted``), else None."""
    return converted.folder(Path(source.path) / source.gguf_file) if source.kind == "gguf" else None


def read_config(source: ModelSource):
    """The model's ``transformers`` config, without reading any weight (GGUF: metadata only, or the config of its
    conversion)."""
    from transformers import AutoConfig

    extra = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    if (cached := _converted(source)) is not None:
        return AutoConfig.from_pretrained(cached, trust_remote_code=False)
    if source.kind == "dir":
        raw = json.loads((Path(source.path) / "config.json").read_text())
        if (fmt := format_of(raw)) is not None and fmt.read_config is not None:
            return fmt.read_config(raw)
    with readable(source):
        config = AutoConfig.from_pretrained(source.path, **extra, trust_remote_code=False)
    if getattr(config, "model_type", None) not in supported_model_types():
        raise SourceError(f"{source.name}: unsupported architecture {getattr(config, 'model_type', None)!r}; "
                         f"spap supports {', '.join(supported_model_types())}")
    return config


def context_length(config) -> int | None:
    """Positions the model was built for (``max_position_embeddings``); None when it does not say."""
    n = getattr(config, "max_position_embeddings", None)
    return int(n) if isinstance(n, int) and n > 0 else None


RUN_DEVICES = ("cpu", "cuda", "mps")  # device types whose kernels hold values and run every step of a prune


def pick_device(device: str = "auto") -> torch.device:
    """The device of a run, refused up front unless it exists on this machine and can run a prune: ``meta`` holds
    no values and other types lack kernels a prune uses, so either would only fail after the model is loaded."""
    if not isinstance(device, str):
        raise ParameterError(f"device must be a string ('auto', 'cpu', 'cuda', 'cuda:0'), got {device!r}")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fix = f"use {option('device', 'cpu')} or {option('device', 'auto')}"  # the devices every machine has
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ParameterError(f"unknown device {device!r}: {fix}, or 'cuda', 'cuda:N', 'mps'") from None
    if dev.type not in RUN_DEVICES:
        raise ParameterError(f"device {device!r} cannot run a prune (spap runs on {', '.join(RUN_DEVICES)}): {fix}")
    gpus = torch.cuda.device_count() if dev.type == "cuda" and torch.cuda.is_available() else 0
    if dev.type == "cuda" and not gpus:
        raise ParameterError(f"device {device!r} requested but CUDA is not available on this machine: {fix}")
    if dev.type == "cuda" and dev.index is not None and dev.index >= gpus:
        raise ParameterError(f"device {device!r} does not exist: this machine has {gpus} CUDA device(s), "
                             f"cuda:0 to cuda:{gpus - 1}: use {option('device', 'cuda:0')}")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ParameterError(f"device {device!r} requested but MPS (Apple GPUs) is not available here: {fix}")
    return dev


def _dequantize(source: ModelSource) -> dict:
    """GGUF weights are unpacked into plain Linear layers: pruning needs dense float weights, and the
    pruned model is saved as an ordinary (stock-loadable) safetensors checkpoint."""
    if not source.gguf_file:
        return {}
    from transformers.utils.quantization_config import GgufConfig

    return {"quantization_config": GgufConfig(gguf_file=source.gguf_file, dequantize=True)}


@dataclass
class Loaded:
    model: torch.nn.Module
    tokenizer: object
    adapter: Adapter
    source: ModelSource
    device: torch.device
    onloader: Onloader | None = None  # where the weights wait between uses (``spap_lib.model.offload``)

    def __post_init__(self):
        if self.onloader is None:
            self.onloader = Onloader(self.model, self.adapter.layers(), self.device)

    @property
    def offload(self) -> str:
        return self.onloader.mode

    def param_counts(self) -> dict:
        """Exact parameter counts: decoder layers only, the MLPs, and the whole model (tied weights once)."""
        return {"decoder": self.adapter.decoder_params(), "total": sum(p.numel() for p in self.model.parameters()),
                "mlp": self.adapter.mlp_params()}

    def copy(self, device: torch.device | str | None = None) -> Loaded:
        """A deep copy of the model (tokenizer and source shared) on ``device`` (default: this one's):
        prune many variants from one load."""
        if self.offload != "none":
            raise ParameterError(f"copy() needs a resident model (offload='none'), this one is "
                                 f"offload={self.offload!r}")
        device = torch.device(device) if device is not None else self.device
        if device == self.device:
            model = copy.deepcopy(self.model)
        else:
            model = _copy_to(self.model, device)
        return Loaded(model, self.tokenizer, get_adapter(model), self.source, device)


def _copy_to(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """A deep copy of ``model`` whose tensors are copied straight to ``device`` (tied weights stay tied):
    no transient second copy on the source device."""
    memo = {}
    for t in [*model.parameters(), *model.buffers()]:
        moved = t.detach().to(device, copy=True)
        memo[id(t)] = torch.nn.Parameter(moved, requires_grad=t.requires_grad) \
            if isinstance(t, torch.nn.Parameter) else moved
    return copy.deepcopy(model, memo)


def load_nonuniform(path: str | Path, dtype: torch.dtype) -> torch.nn.Module:
    """Load a checkpoint whose layers have different MLP widths (``config.spap_mlp_widths``).

    Stock ``from_pretrained`` builds every layer at ``intermediate_size`` and refuses the smaller
    tensors, so the model is built from the config, each layer's MLP is resized to its recorded
    width, and the safetensors weights are loaded strictly (the plan, stored as data, re-applied).
    """
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    adapter = get_adapter(model)
    widths = config.spap_mlp_widths
    if len(widths) != len(adapter.layers()):
        raise SourceError(f"{path}: spap_mlp_widths lists {len(widths)} layers, the model has {len(adapter.layers())}")
    for layer, width in zip(adapter.layers(), widths):
        adapter.resize(layer, width)
    state = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        state.update(load_file(file))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if getattr(config, "tie_word_embeddings", False) and k.startswith("lm_head")}
    if set(missing) - tied or unexpected:
        raise SourceError(f"{path}: checkpoint does not match its config (missing {sorted(set(missing) - tied)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]})")
    model.tie_weights()
    return model.eval()  # as from_pretrained: no dropout (OPT has some)
NONUNIFORM = register_format(CheckpointFormat("spap_mlp_widths", "checkpoint with per-layer MLP widths",
                                             load_nonuniform))


def weight_store(source: ModelSource, skeleton: torch.nn.Module):
    """The model's tensors, readable one at a time (``offload="disk"``): safetensors files of a local
    directory or the hub cache, or a GGUF file; pickle checkpoints are refused with the alternatives."""
    if source.kind == "gguf":
        return GGUFStore(Path(source.path) / source.gguf_file, skeleton)
    folder = Path(source.path)
    if source.kind == "hub":
        from huggingface_hub import is_offline_mode, snapshot_download

        with readable(source):
            folder = Path(snapshot_download(source.path, allow_patterns=["*.safetensors", "*.json", "*.model",
                                                                         "*.txt"], local_files_only=is_offline_mode()))
    return SafetensorsStore(folder)


def _skeleton(source: ModelSource, dtype: torch.dtype) -> torch.nn.Module:
    """The model on the meta device (accelerate's ``init_empty_weights``): shapes, no memory;
    per-layer widths of a spap checkpoint re-applied."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    config = read_config(source)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    widths = getattr(config, "spap_mlp_widths", None)
    if widths:
        adapter = get_adapter(model)
        for layer, width in zip(adapter.layers(), widths):
            adapter.resize(layer, width)
    return model


def _check_loading_report(name: str, source: ModelSource, report: dict) -> None:
    """transformers' own load report: a tensor it had to initialise at random, or could not fit, is an
    error (a GGUF's names come from transformers' own tables and its file is checked when parsed)."""
    if source.kind == "gguf":
        return
    missing, mismatched = report.get("missing_keys") or [], report.get("mismatched_keys") or []
    if missing or mismatched:
        raise SourceError(f"{name}: transformers could not load every tensor from the checkpoint (missing "
                          f"{sorted(missing)[:5]}, shapes differing {sorted(map(str, mismatched))[:3]}); spap never "
                          "prunes a partly random model: use the complete checkpoint")


def load(name: str, device: str = "auto", dtype: str = "auto", offload: str = "none",
         spill_dir: str | Path | None = None) -> Loaded:
    """Load a causal LM and its tokenizer; fail early on architectures spap cannot prune.

    ``offload`` (``spap_lib.model.offload``): ``none`` puts the model on the device; ``cpu`` keeps it in host
    memory; ``disk`` reads only embeddings, final norm and head now, decoder layers when they are
    used (pruned layers are spilled to a folder under ``spill_dir``, default the system temp dir).
    """
    from transformers import AutoModelForCausalLM

    check_offload(offload)
    if offload == "auto":
        raise ParameterError("load() takes offload none, cpu or disk; 'auto' is resolved by the plan (sl.check_run)")
    source = resolve(name)
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    extra = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    raw = json.loads((Path(source.path) / "config.json").read_text()) if source.kind == "dir" else {}
    fmt = format_of(raw)
    if fmt is not None and fmt.resident_only and offload != "none":
        raise ParameterError(f"{name} is a {fmt.describe}: it loads resident only, offload='none' (got {offload!r})")
    cached = _converted(source)  # a GGUF read before: its safetensors folder (``model.converted``)
    with readable(source):
        if cached is not None and offload != "disk" and \
                (got := converted.load_converted(cached, dt, source.path)) is not None:
            model, tokenizer = got
            adapter, onloader = _placed(model, offload, dev)
            return Loaded(model.eval(), with_own_pre_tokenizer(tokenizer, source), adapter, source, dev, onloader)
        # The tokenizer first: from a GGUF it parses the whole vocabulary into transient Python objects, which then
        # peak beside nothing rather than beside the weights (docs/scale.md: Same answer).
        tokenizer = load_tokenizer(source)
        if offload == "disk":
            model = _skeleton(source, dt)
            adapter = get_adapter(model)
            store = weight_store(source, model)
            onloader = DiskOffload(model, adapter.layers(), dev, store, dt, spill_dir)
            load_base(model, onloader, store, dt)
        else:
            if fmt is not None:
                model = fmt.load(source.path, dt)
            else:
                model, report = AutoModelForCausalLM.from_pretrained(
                    source.path, dtype=dt, output_loading_info=True, trust_remote_code=False, **extra,
                    **_dequantize(source))
                _check_loading_report(name, source, report)
                if source.kind == "gguf":
                    converted.convert(Path(source.path) / source.gguf_file, model, tokenizer)
            adapter, onloader = _placed(model, offload, dev)
    model.eval()
    return Loaded(model, tokenizer, adapter, source, dev, onloader)


def load_tokenizer(source: ModelSource):
    """The tokenizer ``load`` gives ``source``, without its weights: a GGUF's from its conversion where there is one,
    split as the model splits text (``gguf_tokenizer.with_own_pre_tokenizer``)."""
    from transformers import AutoTokenizer

    cached = _converted(source)
    extra = {"gguf_file": source.gguf_file} if source.gguf_file and cached is None else {}
    with readable(source):
        tokenizer = AutoTokenizer.from_pretrained(cached if cached is not None else source.path, **extra,
                                                  trust_remote_code=False)
    if source.kind == "gguf" and cached is None:
        # As its conversion and every checkpoint saved from it reload it: transformers' build from a GGUF and the
        # tokenizer class's own build from the saved files differ (Qwen2's adds its NFC normalizer), and one model
        # must have one tokenizer, whichever way it was loaded.
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer.save_pretrained(tmp)
            tokenizer = AutoTokenizer.from_pretrained(tmp, trust_remote_code=False)
    return with_own_pre_tokenizer(tokenizer, source)


def _placed(model: torch.nn.Module, offload: str, dev: torch.device) -> tuple[Adapter, Onloader]:
    """A model read whole, placed on the device (``none``), or in host memory with one layer onloaded at a time."""
    adapter = get_adapter(model)
    layers = adapter.layers()
    onloader = Onloader(model, layers, dev) if offload == "none" else HostOffload(model, layers, dev)
    model.to(dev if offload == "none" else "cpu")
    return adapter, onloader
