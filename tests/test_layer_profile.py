"""``bench/profile_layer.py``: each stage of a layer is charged its own time and FLOPs only (a stage inside another,
such as the rounds' Adam steps, is a row of its own), the closed forms' factorisations are counted, and the rates
are set against the machine's peaks."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile") / "p.csv"
    proc = subprocess.run([sys.executable, "bench/profile_layer.py", "--random", "--layer", "0", "--nsamples", "4",
                           "--seqlen", "64", "--methods", "fasp", "spap/K=3,am_iters=2,adam_steps=2",
                           "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return pd.read_csv(out).set_index(["method", "stage"]), out.with_suffix(".md").read_text()


def test_nested_stages_are_charged_exclusively(profiled):
    frame, _ = profiled
    spap = frame.loc["spap/K=3,am_iters=2,adam_steps=2"]
    # the rounds hold the Adam steps, and the final refit (a callable handed to them) holds a Gram pass
    assert {"rounds", "rounds › Adam steps", "rounds › final refit on every token › Gram pass (Z Zᵀ, Y Zᵀ)",
            "penalty loop (Alg. 1) › solves"} <= set(spap.index)
    # charged twice, a stage's time and FLOPs would exceed what is left of the layer: "other" would go negative
    assert (frame["seconds"] >= 0).all() and (frame["gflop"] >= 0).all()
    # the rounds keep their own FLOPs only (bookkeeping), not their Adam steps' and Gram passes'
    assert spap.loc["rounds", "gflop"] < spap.loc["rounds › Adam steps", "gflop"]


def test_the_closed_forms_factorisations_are_counted(profiled):
    frame, _ = profiled
    n_keep = round(1536 * 0.8)  # SmolLM2's MLP width at 20%
    assert frame.loc[("fasp", "solves"), "gflop"] >= n_keep ** 3 / 3 / 1e9  # at least one Cholesky of the kept width
    assert frame.loc[("fasp", "Gram pass (Z Zᵀ, Y Zᵀ)"), "gflop"] >= 4 * 64 * 1536 * 1536 / 1e9  # Z Zᵀ's triangle


def test_the_markdown_names_both_peaks_and_leaves_absent_stages_blank(profiled):
    _, md = profiled
    assert "float32" in md and "bf16" in md and "% of bf16 peak" in md and "| nan" not in md
