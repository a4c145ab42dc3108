"""Weight stores read tensor by tensor, so a model larger than memory is never read whole.

``SafetensorsStore`` reads a checkpoint folder's shards through ``safe_open``; ``GGUFStore`` reads a GGUF
file one tensor at a time through the ``gguf`` reader and dequantizer (the name mapping is transformers'
own). The offloaders (``offload``) onload a decoder layer from either.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from spap_lib.checks import ParameterError


# -- weight stores: name -> tensor, read on demand ------------------------------------------------
class SafetensorsStore:
    """Tensors of a folder of ``*.safetensors`` files (sharded or not), read one at a time.

    Each read opens the file with ``safe_open`` and closes it again: a handle kept open would keep
    every page read so far mapped into this process (a whole model's worth after one pass).
    """

    def __init__(self, folder: str | os.PathLike, files: list[Path] | None = None):
        from safetensors import safe_open

        self.folder = Path(folder)
        files = sorted(self.folder.glob("*.safetensors")) if files is None else files
        if not files:
            raise ParameterError(_unstreamable(self.folder))
        self.where = {}
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as handle:
                self.where.update(dict.fromkeys(handle.keys(), str(f)))

    def names(self) -> set[str]:
        return set(self.where)

    def describe(self) -> str:
        return str(self.folder)

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        from safetensors import safe_open

        key = name if name in self.where else _strip_model_prefix(name)  # e.g. OPT files without "model."
        with safe_open(self.where[key], framework="pt", device="cpu") as handle:
            return handle.get_tensor(key).to(dtype)

    def rows(self, name: str, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of a 2-D tensor, read alone (an embedding's rows for one batch)."""
        from safetensors import safe_open

        key = name if name in self.where else _strip_model_prefix(name)
        with safe_open(self.where[key], framework="pt", device="cpu") as handle:
            part = handle.get_slice(key)
            return torch.cat([part[i:i + 1] for i in ids.tolist()]).to(dtype)

    def __contains__(self, name: str) -> bool:
        return name in self.where or _strip_model_prefix(name) in self.where


def _strip_model_prefix(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def _unstreamable(folder: Path) -> str:
    pickles = sorted(p.name for p in folder.glob("*.bin"))[:3]
    what = f"pickle weights ({', '.join(pickles)})" if pickles else "no *.safetensors files"
    return (f"{folder} holds {what}: offload='disk' reads safetensors (or a .gguf) tensor by tensor and cannot stream "
            "it. Use offload='cpu' or 'none' (the whole model is read into memory first), or convert the checkpoint "
            "once: AutoModelForCausalLM.from_pretrained(path).save_pretrained(new_path) writes safetensors.")


class _TensorInfo(NamedTuple):
    offset: int
    n_bytes: int
    dtype: object  # numpy dtype of the stored blocks
    shape: tuple
    type: object  # gguf quantization type


class GGUFStore:
    """Tensors of a GGUF file, dequantized one at a time.

    Names and per-architecture fixes (Llama's q/k permutation, Gemma's norm offset) come from
    transformers' own GGUF tables, so a tensor equals what ``from_pretrained(gguf_file=...)`` loads.
    """

    def __init__(self, path: str | os.PathLike, skeleton: nn.Module):
        from gguf import GGUFReader
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            TensorProcessor,
            get_gguf_hf_weights_map,
            read_field,
        )

        self.path = Path(path)
        reader = GGUFReader(str(self.path))
        arch = read_field(reader, "general.architecture")[0]
        # Where each tensor's bytes lie and how to decode them; then the reader goes: it holds every
        # metadata array as Python objects that no read needs, a large vocabulary's too (docs/scale.md: Same answer).
        self._tensors = {t.name: _TensorInfo(int(t.data_offset), int(t.n_bytes), t.data.dtype, tuple(t.data.shape),
                                             t.tensor_type) for t in reader.tensors}
        del reader
        # The processors read head counts and sizes from transformers' names for the config, which the skeleton
        # already has from the same metadata: parsing the file again would hold its vocabulary once more.
        self._parsed = {"config": skeleton.config.to_dict(), "tensors": {}}
        self.processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=self._parsed["config"])
        self._gguf_to_hf = get_gguf_hf_weights_map(skeleton, self.processor)
        self.where = {hf: g for g, hf in self._gguf_to_hf.items() if g in self._tensors}

    def names(self) -> set[str]:
        return set(self.where)

    def describe(self) -> str:
        return str(self.path)

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        import numpy as np

        gguf_name = self.where[name]
        tensor = self._tensors[gguf_name]
        # A plain read rather than a memory map, whose pages would stay mapped into this process (the
        # whole file, after one pass).
        with open(self.path, "rb") as f:
            raw = os.pread(f.fileno(), tensor.n_bytes, tensor.offset)
        return self._decoded(np.frombuffer(raw, dtype=tensor.dtype).reshape(tensor.shape), gguf_name, dtype)

    def rows(self, name: str, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of a 2-D tensor, read and dequantized alone (an embedding's rows for one batch): a GGUF
        stores a matrix row after row, each row's blocks on their own."""
        import numpy as np

        gguf_name = self.where[name]
        tensor = self._tensors[gguf_name]
        width = tensor.n_bytes // tensor.shape[0]
        with open(self.path, "rb") as f:
            raw = b"".join(os.pread(f.fileno(), width, tensor.offset + i * width) for i in ids.tolist())
        return self._decoded(np.frombuffer(raw, dtype=tensor.dtype).reshape(len(ids), *tensor.shape[1:]),
                             gguf_name, dtype)

    def _decoded(self, data, gguf_name: str, dtype: torch.dtype) -> torch.Tensor:
        """Stored blocks as the tensor transformers loads: dequantized, with its architecture's fixes."""
        import numpy as np

        weights = _dequantized(data, self._tensors[gguf_name].type)
        weights = self.processor.process(weights=weights, name=gguf_name, tensor_key_mapping=self._gguf_to_hf,
                                         parsed_parameters=self._parsed).weights
        # One float32 copy of the tensor, not two (a large vocabulary's embeddings; docs/scale.md: Same answer):
        # dequantize returns a fresh array; copy only a permuted view or a read-only array (an
        # unquantized tensor is a view of the bytes read).
        weights = np.ascontiguousarray(weights)
        if not weights.flags.writeable:
            weights = weights.copy()
        return torch.from_numpy(weights).to(dtype)


def _dequantized(data, qtype, rows_per_block: int = 4096):
    """``gguf.dequantize`` a block of rows at a time into one float32 array. Whole, it holds every row group's
    result in a list and then concatenates them: two float32 copies of a large vocabulary's embeddings
    (docs/gguf.md)."""
    import numpy as np
    from gguf import GGMLQuantizationType, dequantize

    rows = data.reshape(-1, data.shape[-1]) if data.ndim > 1 else data[None]
    if qtype == GGMLQuantizationType.F32 or rows.shape[0] <= rows_per_block:
        return dequantize(data, qtype)
    first = dequantize(rows[:rows_per_block], qtype)
    out = np.empty((rows.shape[0], first.shape[-1]), dtype=first.dtype)
    out[:rows_per_block] = first
    for start in range(rows_per_block, rows.shape[0], rows_per_block):
        out[start:start + rows_per_block] = dequantize(rows[start:start + rows_per_block], qtype)
    return out.reshape(*data.shape[:-1], first.shape[-1])
