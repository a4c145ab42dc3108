"""What a user's checkpoint may not do, refused before spap reads it: carry code of its own for transformers to
run (``auto_map``), or describe one model in its config and another in its files (a tying config over a head of
its own, which transformers 4.x and 5.x load as two different models)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from spap_lib.errors import SourceError

# The files in which a checkpoint names code of its own (``auto_map``) that transformers would offer to run.
CODE_NAMING = ("config.json", "tokenizer_config.json", "generation_config.json", "processor_config.json",
               "preprocessor_config.json")


def refuse_remote_code(folder: Path, name: str) -> None:
    """spap never runs code that a checkpoint carries: an ``auto_map`` in its configs (classes in the checkpoint's
    own ``.py`` files, which transformers runs once told yes) is refused before anything is read. Every loader is
    also called with ``trust_remote_code=False``, for what is not yet on disk (a hub model being downloaded)."""
    for file in CODE_NAMING:
        try:
            raw = json.loads((folder / file).read_text())
        except (OSError, ValueError):  # absent, or named as corrupt by the check that reads it
            continue
        if isinstance(raw, dict) and raw.get("auto_map"):
            classes = sorted({str(c) for v in raw["auto_map"].values() for c in (v if isinstance(v, list) else [v])
                              if c})
            raise SourceError(f"{name} carries code of its own ({file}'s auto_map: {', '.join(classes)}), and spap "
                              "never runs code from a checkpoint: use a checkpoint of a stock transformers "
                              f"architecture, or delete auto_map from {folder / file} to load it with transformers' "
                              "own classes")


def tied_pairs(skeleton: torch.nn.Module) -> list[tuple[str, str]]:
    """``(head, embeddings)`` tensor names that a tying config makes one tensor (transformers 5 maps them; 4.x
    lists the head only, tied to the input embeddings)."""
    keys = getattr(skeleton, "_tied_weights_keys", None) or ()
    if isinstance(keys, dict):
        return list(keys.items())
    embeddings = skeleton.get_input_embeddings()
    name = next(n for n, m in skeleton.named_modules() if m is embeddings)
    return [(k, f"{name}.weight") for k in keys]


def refuse_untied_head(folder: Path, head: tuple[str, str], embeddings: tuple[str, str]) -> None:
    """A config that ties the head to the embeddings over files that hold a head of its own, other than the
    embeddings: transformers 4.x loads the tied model, 5.x the head as stored, two models from one checkpoint.
    ``head`` and ``embeddings``: (stored name, file name)."""
    from safetensors import safe_open

    (na, fa), (nb, fb) = head, embeddings
    if not (fa.endswith(".safetensors") and fb.endswith(".safetensors")):
        return  # pickle weights: compared only where safetensors can be read tensor by tensor
    with safe_open(str(folder / fa), framework="pt") as a, safe_open(str(folder / fb), framework="pt") as b:
        sa, sb = a.get_slice(na), b.get_slice(nb)
        rows = sa.get_shape()[0]
        if list(sa.get_shape()) == list(sb.get_shape()) and all(
                torch.equal(sa[i:i + 4096], sb[i:i + 4096]) for i in range(0, rows, 4096)):
            return
    raise SourceError(f"{folder}: config.json ties the output head to the embeddings (tie_word_embeddings: true), "
                      f"but {fa} holds a {na} of its own that differs from {nb}, so transformers 4.x and 5.x load "
                      "two different models from it: set tie_word_embeddings to false in config.json if the stored "
                      f"head is meant, or remove {na} from the weights if the tied one is")
