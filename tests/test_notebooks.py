"""Execute the notebook chain 01 -> 02 with papermill (smoke parameters) and check what it recorded."""
import json
import math
import os
from pathlib import Path

import papermill as pm
import pytest

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


@pytest.mark.slow
def test_calibrate_then_prune_chain(tmp_path):
    run = tmp_path / "run"
    common = {"model": "smollm2-135m", "nsamples": 8, "seqlen": 256, "eval_seqlen": 128, "eval_windows": 4,
              "run_dir": str(run)}
    pm.execute_notebook(NOTEBOOKS / "01_calibrate.ipynb", tmp_path / "01.ipynb", parameters=common,
                        progress_bar=False, cwd=str(NOTEBOOKS))
    dense = json.loads((run / "dense.json").read_text())
    assert (run / "calibration.pt").is_file() and math.isfinite(dense["perplexity"]["ppl"])

    pm.execute_notebook(NOTEBOOKS / "02_prune.ipynb", tmp_path / "02.ipynb",
                        parameters={**common, "sparsity": 0.2, "out_dir": str(tmp_path / "pruned")},
                        progress_bar=False, cwd=str(NOTEBOOKS))
    result = json.loads((run / "prune_result.json").read_text())
    assert result["perplexity"]["dense"] == dense["perplexity"]  # reused, not recomputed
    assert abs(result["sparsity"]["achieved_decoder"] - 0.2) < 2e-3
    assert result["reload_max_abs_diff"] < 1e-4
    assert result["calibration"]["split"] in {"train", "validation"}
    ppl = result["perplexity"]["pruned"]["ppl"]
    assert math.isfinite(ppl) and ppl < 3 * dense["perplexity"]["ppl"]
    assert (tmp_path / "pruned" / "config.json").is_file() and (tmp_path / "pruned" / "spap_manifest.json").is_file()


def test_bad_parameter_fails_before_work(tmp_path):
    with pytest.raises(pm.PapermillExecutionError, match="unknown method"):
        pm.execute_notebook(NOTEBOOKS / "02_prune.ipynb", tmp_path / "bad.ipynb",
                            parameters={"method": "nope", "run_dir": str(tmp_path / "run"),
                                        "out_dir": str(tmp_path / "out")},
                            progress_bar=False, cwd=str(NOTEBOOKS))
    assert not (tmp_path / "out").exists() and not (tmp_path / "run" / "dense.json").exists()
