"""A saved checkpoint in llama.cpp: converted to GGUF by llama.cpp's own converter, quantized by llama.cpp, and
opened in llama-cpp-python.

The converter (``convert_hf_to_gguf.py`` with its ``gguf-py``) ships inside llama-cpp-python's source
distribution, so the converter and the engine are always the same llama.cpp revision. ``make setup-engines``
downloads that distribution into ``ENGINE_DIR``, unpacks it there and builds the engine from it (minutes).
Neither is a dependency of spap itself: everything here imports them only when called.
"""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from spap_lib.errors import ParameterError, SourceError
from spap_lib.files import REPO, atomic_file

ENGINE = "llama-cpp-python"
ENGINE_VERSION = "0.3.36"  # requirements-engines.txt pins the same release
ENGINE_DIR = REPO / "bench" / ".cache" / "engines"  # where `make setup-engines` unpacks the source distribution
SETUP = "run `make setup-engines` (downloads llama-cpp-python's source and builds llama.cpp from it, minutes)"
# llama.cpp's file types by the names users know them by; f16 is the converter's output, the others the quantizer's.
QUANTS = {"f16": "LLAMA_FTYPE_MOSTLY_F16", "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}


def converter(root: Path = ENGINE_DIR) -> Path:
    """``convert_hf_to_gguf.py`` of the pinned llama-cpp-python release, or a refusal saying how to get it."""
    path = root / f"llama_cpp_python-{ENGINE_VERSION}" / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"
    if not path.is_file():
        raise SourceError(f"llama.cpp's converter is not in {root}: {SETUP}")
    return path


def engine():
    """The ``llama_cpp`` module of the pinned release, or a refusal saying how to build it."""
    try:
        import llama_cpp
    except ImportError:
        raise SourceError(f"llama-cpp-python is not installed: {SETUP}") from None
    if llama_cpp.__version__ != ENGINE_VERSION:
        raise SourceError(f"llama-cpp-python {llama_cpp.__version__} is installed, the converter is "
                          f"{ENGINE_VERSION}'s: {SETUP}")
    return llama_cpp


def check_convertible(checkpoint: str | Path) -> dict:
    """The checkpoint's config, after refusing what llama.cpp cannot hold: per-layer MLP widths (a GGUF file,
    like a stock transformers config, has one feed-forward width for every layer)."""
    config_path = Path(checkpoint) / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as err:
        raise SourceError(f"{checkpoint} is not a saved checkpoint ({config_path}: {err})") from None
    if config.get("spap_mlp_widths"):
        raise ParameterError(f"{checkpoint} has per-layer MLP widths (spap_mlp_widths): llama.cpp, like stock "
                             "transformers, needs one width for every layer; prune with allocation=uniform "
                             "(the default) to convert it")
    return config


def to_gguf(checkpoint: str | Path, out: str | Path, root: Path = ENGINE_DIR) -> Path:
    """``checkpoint`` as an f16 GGUF file at ``out``, written atomically by llama.cpp's converter."""
    check_convertible(checkpoint)
    script = converter(root)
    with atomic_file(out) as tmp:
        run = subprocess.run([sys.executable, str(script), str(checkpoint), "--outfile", str(tmp), "--outtype", "f16"],
                             capture_output=True, text=True,
                             env={k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"})  # its own gguf-py
        if run.returncode != 0:
            raise SourceError(f"llama.cpp's converter failed on {checkpoint}: {run.stderr.strip()[-600:]}")
    return Path(out)


def quantize(f16: str | Path, out: str | Path, quant: str, threads: int) -> Path:
    """``f16`` quantized to ``quant`` (a key of QUANTS) by llama.cpp, written atomically to ``out``."""
    if quant not in QUANTS or quant == "f16":
        raise ParameterError(f"quant {quant!r}: expected one of {', '.join(q for q in QUANTS if q != 'f16')}")
    llama_cpp = engine()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, QUANTS[quant])
    params.nthread = threads
    with atomic_file(out) as tmp:
        if llama_cpp.llama_model_quantize(str(f16).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
            raise SourceError(f"llama.cpp could not quantize {f16} to {quant}")
    return Path(out)


def amx() -> bool:
    """Whether this CPU has AMX: there llama.cpp's repacked AMX weights crash a Q4_K_M forward
    (ggml-org/llama.cpp#20824, reproduced with the pinned release), so spap opens files without repacking."""
    try:
        return "amx_int8" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@contextmanager
def _model_defaults(**fields):
    """llama-cpp-python's ``Llama`` fills llama.cpp's model parameters from their defaults and exposes no switch for
    some of them (weight repacking among them): the defaults it reads are changed while it opens a file."""
    low = engine().llama_cpp
    default = low.llama_model_default_params

    def changed():
        params = default()
        for name, value in fields.items():
            setattr(params, name, value)
        return params

    low.llama_model_default_params = changed
    try:
        yield
    finally:
        low.llama_model_default_params = default


def open_model(path: str | Path, n_ctx: int, threads: int, logits_all: bool, repack: bool):
    """A GGUF file opened in llama-cpp-python on the CPU, one batch as wide as the context; ``repack``: llama.cpp's
    repacked weight layouts (its default; see ``amx``)."""
    with _model_defaults(use_extra_bufts=repack):
        return engine().Llama(str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=threads,
                              n_threads_batch=threads, logits_all=logits_all, n_gpu_layers=0, verbose=False)
