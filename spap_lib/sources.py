"""A checkpoint folder checked against its config before any weight is read.

transformers loads a checkpoint that lacks a tensor with that tensor randomly initialised and one line
on stderr; spap would then prune, evaluate and save a partly random model. So every local folder is
checked up front, from the safetensors headers alone (``safe_open`` reads names and shapes and refuses
a file shorter than its header announces), against the model its config describes, built on the meta
device: a missing tensor, a shape that disagrees and a tensor the config does not use are errors that
name the tensor; a truncated or unreadable file and a missing shard are named as such.
Pickle checkpoints (``*.bin``) are read lazily with ``torch.load(mmap=True)``, tensors unmaterialised.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from .errors import SourceError

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
            raise SourceError(f"{f} is truncated or unreadable ({type(err).__name__}: {err}); download or copy "
                              "it again, or save the model as safetensors") from None
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
