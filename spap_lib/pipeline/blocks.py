"""The block sizes of the formats pruned models are deployed to, and what a kept MLP width costs in them.

A block format quantizes a matrix in blocks along its inner dimension. The MLP's output projection (``down_proj``,
llama.cpp's ``ffn_down``) has the MLP width as its inner dimension, so a width the block does not divide leaves
the largest MLP matrix out of the format: llama.cpp's quantizer falls back from a K-quant to a 32-block type where
32 divides the width, and to f16 where it does not (``llama_tensor_get_type`` in llama.cpp's ``llama-quant.cpp``).
What that costs in file size and speed is measured in docs/llamacpp.md.

``round_to`` takes a number or one of these names (``--round-to q4_k_m``).
"""
from __future__ import annotations

from collections.abc import Iterable

from spap_lib.checks import ParameterError, Spec
from spap_lib.errors import option, option_name

LEGACY, K_QUANT = 32, 256  # ggml's QK8_0 (= QK4_0 = QK5_0 = QK4_1 = QK5_1) and QK_K

BLOCKS = {
    # llama.cpp's quantizer types (llama-quantize's names, lower case): the legacy formats and IQ4_NL use 32-value
    # blocks, the K-quants and the other IQ types 256-value super-blocks
    **dict.fromkeys(("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "iq4_nl"), LEGACY),
    **dict.fromkeys(("q2_k", "q2_k_s", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k",
                     "iq2_xxs", "iq2_xs", "iq2_s", "iq2_m", "iq3_xxs", "iq3_xs", "iq3_s", "iq3_m", "iq4_xs",
                     "iq1_s", "iq1_m"), K_QUANT),
    # GPU kernels: fp16/bf16 tensor-core products want every dimension a multiple of 8 (NVIDIA's matrix
    # multiplication guide); group-wise int4 (GPTQ, AWQ, Marlin kernels) quantizes groups of 128 inner values
    "tensor_core": 8,
    "int4_g128": 128,
}


# `spap prune`'s default (`--round-to auto`): widths the legacy formats' 32 divides, where the MLP is at least 16
# blocks wide. Rounding to the nearest multiple moves a layer's width by at most half a block, 16 channels, a 32nd
# of such an MLP; a narrower one (a test model) keeps its exact widths. Why 32 and not the paper's exact widths: the
# table in docs/llamacpp.md ("Which widths to keep").
AUTO, AUTO_MIN_WIDTH = LEGACY, 16 * LEGACY


def auto_round_to(width: int) -> int | None:
    """What ``--round-to auto`` means for a model whose MLP is ``width`` wide: 32 where 32 divides the width and
    it is at least ``AUTO_MIN_WIDTH``, else no rounding."""
    return AUTO if width % AUTO == 0 and width >= AUTO_MIN_WIDTH else None


def is_auto(round_to) -> bool:
    return isinstance(round_to, str) and round_to.strip().lower() == "auto"


def resolve_round_to(round_to: int | str | None, mlp_width: int, layers: bool) -> int | None:
    """``round_to`` as a multiple (``round_to_value``); ``auto`` as ``auto_round_to`` of the model's ``mlp_width``
    where the method keeps MLP channels layer by layer (``layers``), and no rounding for a whole-model method
    (SliceGPT keeps its own dimensions)."""
    if not is_auto(round_to):
        return round_to_value(round_to)
    return auto_round_to(mlp_width) if layers else None


def round_to_value(round_to: int | str | None) -> int | None:
    """``round_to`` as a multiple: a whole number ``>= 1`` as it is (``"64"`` from a command line too), a format's
    name as its block size, ``None`` or ``"none"`` as no rounding (the method's own widths); anything else is
    refused with what it accepts."""
    if isinstance(round_to, str):
        name = round_to.strip().lower()
        if name == "none":
            return None
        if name in BLOCKS:
            return BLOCKS[name]
        if not name.isdigit():
            raise ParameterError(f"{option_name('round_to')} {round_to!r} is not a format spap knows the blocks of; "
                                 f"use a number (for example {option('round_to', 64)}), none, or one of: "
                                 f"{', '.join(BLOCKS)}")
        round_to = int(name)
    return Spec(int, ge=1, optional=True).check("round_to (a kept-width multiple such as 64, or a format such as "
                                                "q4_k_m)", round_to)


def width_note(widths: Iterable[int]) -> str | None:
    """One line on what kept MLP widths cost in llama.cpp's block formats and which ``round_to`` avoids it, or
    ``None`` where its K-quants' 256 divides every width."""
    odd = sorted({int(w) for w in widths if w % K_QUANT})
    if not odd:
        return None
    shown = ", ".join(map(str, odd[:3])) + (", ..." if len(odd) > 3 else "")
    avoid = f"{option('round_to', 'q4_k_m')} (a multiple of {K_QUANT}) avoids it"
    if any(w % LEGACY for w in odd):
        return (f"MLP width {shown} is not a multiple of {LEGACY}: llama.cpp keeps every ffn_down in f16 in its "
                f"quantized files (Q8_0, Q4_K_M; such a file can be larger than the dense one and no faster); "
                f"{option('round_to', 'q8_0')} (a multiple of {LEGACY}) makes Q8_0 and the legacy formats whole, "
                f"{avoid} (docs/llamacpp.md)")
    return (f"MLP width {shown} is a multiple of {LEGACY}, not of {K_QUANT}: llama.cpp's K-quants (Q4_K_M) store "
            f"ffn_down in Q5_0/Q5_1/Q8_0 instead; {avoid} (docs/llamacpp.md)")
