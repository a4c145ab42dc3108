"""Every MLP-channel method's prune of the tiny models, summarised: the reference its preset must reproduce.

The methods are presets of one composition (``spap_lib.methods.parts.selection``); ``tests/data/presets.json`` pins
what each one keeps and its weights' sums. Rewrite it only for a change that means to alter a method's
result:

    python tests/presets.py tests/data/presets.json
"""
from __future__ import annotations

import json
import sys

import torch
from conftest import calibration

FAST = {"K": 5, "am_iters": 2, "adam_steps": 2, "batch_tokens": 32}
CASES = {  # label: (method, hyperparameters)
    "spap": ("spap", FAST), "spap_no_update": ("spap_no_update", {"K": 5}), "spap_gd": ("spap_gd", FAST),
    "fasp": ("fasp", {}), "cfsp": ("cfsp", {}), "flap": ("flap", {}), "wanda_sp": ("wanda_sp", {}),
    "magnitude": ("magnitude", {}), "spap/allocation=global": ("spap", {**FAST, "allocation": "global"}),
    "spap_no_update/allocation=angular": ("spap_no_update", {"K": 5, "allocation": "angular"}),
}
ARCHS = ("opt", "llama", "qwen2")
# How far a weight sum may move, as a fraction of its layer's largest sum of |.|: float32 kernels differ between CPUs
# (torch's AVX-512, AVX2 and default paths), and Adam's normalised steps carry that into the weights. Measured on
# these cases across the three paths: at most 2.6e-6 without Adam steps and 6.2e-4 with; two different updates
# differ by 2.5e-3 or more. The kept channels agree exactly on every path at this calibration size.
TOLERANCE = {"adam": 2e-3, "closed form": 1e-5}


def tolerance(label: str) -> float:
    return TOLERANCE["adam" if CASES[label][1].get("adam_steps") else "closed form"]


def snapshot(arch: str, method: str, hparams: dict) -> dict:
    """Kept channels per layer and, per layer, [sum, sum of |.|] of every MLP tensor after a 30% prune."""
    from conftest import tiny_model

    import spap_lib as sl
    from spap_lib.model.loading import Loaded
    from spap_lib.model.sources import ModelSource

    if method == "flap" and arch == "qwen2":
        hparams = {**hparams, "bias": False}  # no bias slot
    windows = torch.randint(0, 128, (16, 32), generator=torch.Generator().manual_seed(1))
    calib = calibration(windows)
    model = tiny_model(arch)
    loaded = Loaded(model, None, sl.get_adapter(model), ModelSource(f"tiny-{arch}", "dir", "-"), torch.device("cpu"))
    report = sl.prune(loaded, calib, method, 0.3, hparams=hparams, progress=False)
    sums = []
    for layer in loaded.adapter.layers():
        mlp = loaded.adapter.get_mlp(layer)
        tensors = [*mlp.W_in, mlp.W_out, *(b for b in (*mlp.b_in, mlp.b_out) if b is not None)]
        sums.append([[float(t.double().sum()), float(t.double().abs().sum())] for t in tensors])
    return {"kept": report["kept_channels"], "sums": sums}


if __name__ == "__main__":
    out = {f"{arch}/{label}": snapshot(arch, *case) for arch in ARCHS for label, case in CASES.items()}
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=None, separators=(",", ":"))
