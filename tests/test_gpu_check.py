"""``make gpu-check DRY=1``: the GPU command's every step on tiny shapes, so it is known to work before device
time is spent on it, and a second call resumes after the rows the first wrote."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "bench" / "gpu_check.py"


def _run(out: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry", "--out", str(out)], capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_check")
    return out, _run(out)


def test_the_dry_run_writes_every_step_and_prints_the_summary_last(dry):
    out, proc = dry
    summary = (out / "summary.md").read_text()
    assert proc.stdout.rstrip().endswith(summary.rstrip())
    assert "Revision:" in summary and "torch" in summary and "CUDA" in summary and "pytest -m gpu" in summary
    layers = pd.read_csv(out / "layers.csv")
    assert layers["name"].is_unique and {"8b spap resident", "8b fasp offload=cpu", "70b spap offload=cpu",
                                          "qwen0.5b spap", "qwen0.5b fasp"} <= set(layers["name"])
    assert (layers["seconds"] > 0).all() and (layers["plan seconds"] > 0).all()
    assert layers["host peak GB"].gt(0).all() and "outside band" in layers
    assert any(layers.filter(like="s: ").sum() > 0)  # the stages were timed
    decode = pd.read_csv(out / "decode.csv")
    assert list(decode["variant"]) == ["dense", "20%"]  # the full run: 10%, 20% and 30%
    assert decode["bytes_bound"].iloc[1:].gt(1).all() and decode["tokens_per_s"].gt(0).all()


def test_a_second_call_resumes_after_the_rows_written(dry):
    out, _ = dry
    layers = (out / "layers.csv").read_text()
    proc = _run(out)
    assert proc.stdout.count("measured already at this revision") == len(pd.read_csv(out / "layers.csv"))
    assert (out / "layers.csv").read_text() == layers


def test_the_full_run_refuses_a_machine_without_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode != 0 and "--dry" in proc.stderr
