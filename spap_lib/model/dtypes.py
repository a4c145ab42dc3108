"""The two dtypes of a run: the one it computes in and the one its checkpoint is saved in.

A CPU computes in float32 (half-precision matmuls are slow and inexact there), a GPU in bfloat16. The
checkpoint is saved, by default, in the dtype the source's *weights* are stored in, read from the files
themselves (safetensors headers, a GGUF's tensor types, the hub's safetensors metadata): a config's ``dtype``
is only a hint, and a bf16 checkpoint pruned on a CPU, or with its layers offloaded, is still saved as bf16,
not at twice its size. A quantized GGUF has no float dtype of its own: it is saved in the working dtype.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from spap_lib.errors import ParameterError
from spap_lib.files import hub_snapshot

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SAVE_DTYPES = ("auto", *DTYPES)
# the float types of safetensors headers and GGUF tensors (the hub's metadata uses the safetensors names)
_STORED = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: float32 on CPU (half-precision matmuls are slow and inexact there), bfloat16 on GPU."""
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in DTYPES:
        raise ParameterError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class RunDtypes:
    """The dtype a run computes in, the one it saves in, and the source's (``None``: quantized or unknown)."""

    working: torch.dtype
    saved: torch.dtype
    source: torch.dtype | None
    source_note: str  # what the source's dtype was read from: "bfloat16 weights", "GGUF Q4_1, quantized"

    def note(self) -> str:
        """For a run's summary: ``weights computed in float32; saved as bfloat16 (source bfloat16 weights)``."""
        return (f"weights computed in {dtype_name(self.working)}; saved as {dtype_name(self.saved)} "
                f"(source {self.source_note})")

    def as_dict(self) -> dict:
        """The report's ``dtype`` entry; ``checkpoint.save`` writes the weights in ``saved``."""
        return {"computed": dtype_name(self.working), "saved": dtype_name(self.saved),
                "source": dtype_name(self.source), "note": self.note()}


def run_dtypes(choice: str, source, config, working: torch.dtype) -> RunDtypes:
    """``choice`` (``save_dtype``): ``auto`` keeps the source's dtype (``working`` where the source has none),
    or one of ``DTYPES``, whatever the offload: weights are cast as they are written."""
    if choice not in SAVE_DTYPES:
        raise ParameterError(f"unknown save dtype {choice!r}; use one of {', '.join(SAVE_DTYPES)}")
    stored, note = source_dtype(source, config)
    if choice != "auto":
        saved = DTYPES[choice]
    else:
        saved = stored if stored in DTYPES.values() else working
    return RunDtypes(working, saved, stored, note)


def saved_dtype(report: dict) -> torch.dtype | None:
    """The dtype a run's report says its checkpoint is saved in (``RunDtypes.as_dict``); None where it does not."""
    name = (report.get("dtype") or {}).get("saved")
    return DTYPES[name] if name else None


def source_dtype(source, config) -> tuple[torch.dtype | None, str]:
    """The dtype most of the source's weights are stored in, and what says so. The config's ``dtype`` is used only
    where the weights cannot be read without downloading them (a hub model offline, not in the cache)."""
    counts, what = stored_dtypes(source)
    claimed = _config_dtype(config)
    if not counts:
        return claimed, f"{dtype_name(claimed)}, as its config says" if claimed else "dtype unknown"
    top = counts.most_common(1)[0][0]
    dtype = _STORED.get(top)
    if dtype is None:
        return None, f"{what} {'/'.join(counts)}, quantized"
    note = f"{dtype_name(dtype)} {what}"
    if claimed is not None and claimed != dtype:
        note += f"; its config says {dtype_name(claimed)}"
    return dtype, note


def _config_dtype(config) -> torch.dtype | None:
    dtype = getattr(config, "dtype", None)
    dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    return dtype if isinstance(dtype, torch.dtype) else None


def stored_dtypes(source) -> tuple[Counter, str]:
    """Elements per stored type (``F32``, ``BF16``, ``Q4_K``…) of a source's weights, from file headers only; empty
    where they are out of reach (offline and not cached)."""
    if source.kind == "gguf":
        return _gguf_types(Path(source.path) / source.gguf_file), "GGUF"
    folder = Path(source.path) if source.kind == "dir" else hub_snapshot(source.path)
    if folder is not None and (files := sorted(folder.glob("*.safetensors"))):
        return _safetensors_types(files), "weights"
    if folder is not None and (files := sorted(folder.glob("*.bin"))):
        return _pickle_types(files), "weights"
    return (_hub_metadata_types(source.path), "weights") if source.kind == "hub" else (Counter(), "weights")


def _safetensors_types(files: list[Path]) -> Counter:
    from safetensors import safe_open

    counts = Counter()
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            for key in handle.keys():
                part = handle.get_slice(key)
                counts[str(part.get_dtype())] += math.prod(part.get_shape())
    return counts


def _pickle_types(files: list[Path]) -> Counter:
    names = {v: k for k, v in _STORED.items()}
    counts = Counter()
    for f in files:  # memory-mapped: only the dtypes and shapes are read
        try:
            state = torch.load(f, map_location="cpu", mmap=True, weights_only=True)
        except Exception:  # noqa: BLE001 - a legacy pickle cannot be mapped: its config's dtype is the hint left
            return Counter()
        for t in state.values():
            counts[names.get(t.dtype, str(t.dtype))] += t.numel()
    return counts


def _gguf_types(path: Path) -> Counter:
    from gguf import GGUFReader

    counts = Counter()
    for t in GGUFReader(str(path)).tensors:
        counts[t.tensor_type.name] += int(t.n_elements)
    return counts


def _hub_metadata_types(repo: str) -> Counter:
    """Parameters per dtype from the hub's safetensors metadata (headers only, no weights); empty offline."""
    from huggingface_hub import get_safetensors_metadata, is_offline_mode

    if is_offline_mode():
        return Counter()
    try:
        return Counter(get_safetensors_metadata(repo).parameter_count)
    except Exception:  # noqa: BLE001 - unreachable, or pickle weights: the config's dtype is the hint left
        return Counter()
