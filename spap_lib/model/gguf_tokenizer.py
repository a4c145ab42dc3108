"""A GGUF's tokenizer splitting text as its model does.

transformers builds a GGUF's tokenizer from the vocabulary and merges, and its pre-tokenizer from the file's
``tokenizer.ggml.pre`` only for the names in its own table; others get a plain byte-level split. SmolLM2's
(``smollm``) splits digits one by one first, as the model's own tokenizer and llama.cpp do: without it ``"a  1"``
becomes ``a, Ġ, Ġ, 1`` instead of ``a, ĠĠ, 1``. ``with_own_pre_tokenizer`` sets the split for the names in
``SPLITS`` and leaves every other tokenizer as transformers made it.

``load`` applies it, so the calibration and evaluation ids and the tokenizer saved with a pruned checkpoint split
text as the model does. Rows and caches record the tokenizer's digest (``keys.tokenizer_digest``): those made with
transformers' split are not reused for this one (docs/reproduce.md: Engines and versions).
"""
from __future__ import annotations

import struct
from pathlib import Path


def _smollm():
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])


SPLITS = {"smollm": _smollm}  # tokenizer.ggml.pre -> the model's own pre-tokenizer

_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes
_STRING, _ARRAY = 8, 9


def gguf_string(path: str | Path, key: str) -> str | None:
    """One string field of a GGUF's metadata, read by walking the header up to it: gguf's reader would parse
    every field, the whole vocabulary among them, into Python objects."""
    with open(path, "rb") as f:
        magic, _version, _tensors, fields = struct.unpack("<4sIQQ", f.read(24))
        if magic != b"GGUF":
            return None
        for _ in range(fields):
            name = f.read(struct.unpack("<Q", f.read(8))[0]).decode()
            kind = struct.unpack("<I", f.read(4))[0]
            if name == key:
                return f.read(struct.unpack("<Q", f.read(8))[0]).decode() if kind == _STRING else None
            _skip(f, kind)
    return None


def _skip(f, kind: int) -> None:
    if kind == _STRING:
        f.seek(struct.unpack("<Q", f.read(8))[0], 1)
    elif kind == _ARRAY:
        item, count = struct.unpack("<IQ", f.read(12))
        if item in _SCALARS:
            f.seek(_SCALARS[item] * count, 1)
        else:
            for _ in range(count):
                _skip(f, item)
    else:
        f.seek(_SCALARS[kind], 1)


def with_own_pre_tokenizer(tokenizer, source):
    """``tokenizer`` of ``source`` (a ``ModelSource``), for a GGUF with the pre-tokenizer its model splits text
    with (transformers' own build otherwise)."""
    if source.kind != "gguf":
        return tokenizer
    split = SPLITS.get(gguf_string(Path(source.path) / source.gguf_file, "tokenizer.ggml.pre"))
    if split is not None:
        tokenizer.backend_tokenizer.pre_tokenizer = split()
        tokenizer.spap_rebuilt = True  # ``rebuilt``: ids recorded before spap split text this way are not its ids
    return tokenizer


def rebuilt(tokenizer) -> bool:
    """Whether spap changed how ``tokenizer`` splits text from transformers' build (``with_own_pre_tokenizer``)."""
    return bool(getattr(tokenizer, "spap_rebuilt", False))
