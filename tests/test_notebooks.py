"""Execute the notebook chain 01 -> 02 with papermill (smoke parameters) and check what it recorded."""
import json
import math
import os
from pathlib import Path

import papermill as pm
import pytest

from spap_lib.nbparams import for_notebook

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
SMOKE = Path(__file__).resolve().parents[1] / "configs" / "smoke.yaml"  # the one source of the smoke settings


def smoke(notebook: str, **override) -> dict:
    """configs/smoke.yaml's parameters for ``notebook`` (only the names it declares), plus ``override``."""
    return {**for_notebook(SMOKE, NOTEBOOKS / notebook), **override}


@pytest.mark.slow
def test_calibrate_then_prune_chain(tmp_path):
    run = tmp_path / "run"
    pm.execute_notebook(NOTEBOOKS / "01_calibrate.ipynb", tmp_path / "01.ipynb",
                        parameters=smoke("01_calibrate.ipynb", run_dir=str(run)), progress_bar=False,
                        cwd=str(NOTEBOOKS))
    dense = json.loads((run / "dense.json").read_text())
    assert (run / "calibration.pt").is_file() and math.isfinite(dense["perplexity"]["ppl"])

    pm.execute_notebook(NOTEBOOKS / "02_prune.ipynb", tmp_path / "02.ipynb",
                        parameters=smoke("02_prune.ipynb", run_dir=str(run), out_dir=str(tmp_path / "pruned")),
                        progress_bar=False, cwd=str(NOTEBOOKS))
    result = json.loads((run / "prune_result.json").read_text())
    assert result["perplexity"]["dense"] == dense["perplexity"]  # reused, not recomputed
    assert abs(result["sparsity"]["achieved_decoder"] - 0.2) < 2e-3
    assert result["reload_max_abs_diff"] < 1e-4
    assert result["calibration"]["split"] in {"train", "validation"}
    ppl = result["perplexity"]["pruned"]["ppl"]
    assert math.isfinite(ppl) and ppl < 3 * dense["perplexity"]["ppl"]
    assert (tmp_path / "pruned" / "config.json").is_file() and (tmp_path / "pruned" / "spap_manifest.json").is_file()
    assert result["offload"] == "none"  # auto: everything fits this machine

    # The same prune with the weights read layer by layer from the GGUF, evaluation streamed too:
    # the same channels (the same perplexity) and a stock-loadable sharded checkpoint.
    pm.execute_notebook(NOTEBOOKS / "02_prune.ipynb", tmp_path / "02d.ipynb",
                        parameters=smoke("02_prune.ipynb", run_dir=str(run), out_dir=str(tmp_path / "pruned-disk"),
                                         offload="disk"),
                        progress_bar=False, cwd=str(NOTEBOOKS))
    streamed = json.loads((run / "prune_result.json").read_text())
    assert streamed["offload"] == "disk"
    assert math.isclose(streamed["perplexity"]["pruned"]["ppl"], ppl, rel_tol=1e-6)
    assert (tmp_path / "pruned-disk" / "model.safetensors.index.json").is_file()
    assert not list(run.glob(".spap-spill-*"))  # the spill folder is gone with the run

    # 04: dense vs the checkpoint 02 wrote, perplexity + six zero-shot tasks (4 examples each)
    import pandas as pd

    pm.execute_notebook(NOTEBOOKS / "04_evaluate.ipynb", tmp_path / "04.ipynb",
                        parameters=smoke("04_evaluate.ipynb", run_dir=str(run), checkpoint=str(tmp_path / "pruned")),
                        progress_bar=False, cwd=str(NOTEBOOKS))
    zs = pd.read_csv(run / "zeroshot.csv")
    assert set(zs["method"]) == {"dense", "spap"} and set(zs["sparsity"]) == {0.0, 0.2} and set(zs["limit"]) == {4}
    tasks = {"arc_easy", "arc_challenge", "piqa", "openbookqa", "winogrande", "rte"}
    assert set(zs["task"]) == tasks | {"wikitext2"}
    acc = zs[zs["task"] != "wikitext2"]
    assert acc["value"].between(0, 1).all() and (acc["n"] == 4).all() and set(acc["source"]) == {"local"}
    ppl = zs[zs["task"] == "wikitext2"].set_index("method")["value"]
    assert math.isclose(ppl["dense"], dense["perplexity"]["ppl"], rel_tol=1e-6)

    # 05: generation time and peak memory, dense vs 20% (and 20% with widths rounded to 64)
    pm.execute_notebook(NOTEBOOKS / "05_profile.ipynb", tmp_path / "05.ipynb",
                        parameters=smoke("05_profile.ipynb", run_dir=str(run), variant_round_to=[None, 64], new_tokens=4,
                                         repeats=1, rounds=2),
                        progress_bar=False, cwd=str(NOTEBOOKS))
    prof = pd.read_csv(run / "profile.csv")
    assert list(prof["variant"]) == ["dense", "20%", "20% r64"]
    assert (prof["seconds_median"] > 0).all() and (prof["peak_mem_mb"] > 0).all()
    assert (prof["runs"] == 2).all() and (prof["seconds_min"] <= prof["seconds_max"]).all()
    assert prof["bytes_bound"].iloc[0] == 1 and (prof["bytes_bound"].iloc[1:] > 1.1).all()
    assert prof["weights_read"].iloc[2] % 1 == 0 and prof["round_to"].iloc[2] == 64
    # The variants are data (kept channels per layer), not checkpoints written to disk.
    variants = json.loads((run / "profile_variants.json").read_text())
    assert variants["dense"]["kept_channels"] is None and len(variants["20% r64"]["kept_channels"]) == 30
    assert all(len(k) % 64 == 0 for k in variants["20% r64"]["kept_channels"])
    assert not list(run.rglob("*.safetensors"))  # (02's checkpoints went to tmp_path, outside run)


@pytest.mark.parametrize("bad, message", [
    ({"method": "nope"}, "unknown method"),
    ({"sparsty": 0.5}, r"does not take the parameter\(s\) 'sparsty' \(did you mean 'sparsity'\?\)"),
    ({"overwrite": "False"}, "overwrite must be a boolean"),
    ({"eval_windows": -1}, "eval_windows must be an integer >= 1 or None"),
    ({"hparams": {"K": -1}}, "K must be an integer >= 1"),
    ({"seqlen": 100_000}, "longer than smollm2-135m's context of 8192"),
    ({"offload": "gpu"}, "unknown offload 'gpu': use one of auto, none, cpu, disk"),
])
def test_bad_parameter_fails_before_work(tmp_path, bad, message):
    """A typo, a wrong type or a value out of range stops 02 before it loads a weight, writing nothing."""
    with pytest.raises(pm.PapermillExecutionError, match=message):
        pm.execute_notebook(NOTEBOOKS / "02_prune.ipynb", tmp_path / "bad.ipynb",
                            parameters={"run_dir": str(tmp_path / "run"), "out_dir": str(tmp_path / "out"), **bad},
                            progress_bar=False, cwd=str(NOTEBOOKS))
    assert not (tmp_path / "out").exists() and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_ablate_notebook_records_every_method_then_redraws_from_the_table(tmp_path):
    import pandas as pd

    run = tmp_path / "run"
    params = smoke("03_ablate.ipynb", run_dir=str(run), results_csv=str(run / "ablation.csv"),
                   figure=str(run / "fig.png"))
    pm.execute_notebook(NOTEBOOKS / "03_ablate.ipynb", tmp_path / "03.ipynb", parameters=params,
                        progress_bar=False, cwd=str(NOTEBOOKS))
    table = pd.read_csv(run / "ablation.csv")
    methods = ["magnitude", "wanda_sp", "flap", "cfsp", "fasp", "spap_no_update", "spap_gd", "spap"]
    assert set(table["label"]) == {"dense", *methods}
    pruned = table[table["label"] != "dense"]
    assert (pruned["sparsity"] == 0.2).all() and (pruned["achieved_sparsity"] - 0.2).abs().max() < 2e-3
    assert pruned["ppl"].map(math.isfinite).all()
    dense = float(table.loc[table["label"] == "dense", "ppl"].iloc[0])
    assert (pruned.set_index("label")["ppl"] > dense).all()  # pruning costs something
    assert json.loads((run / "ablation.manifest.json").read_text())["methods"] == methods
    first = (run / "fig.png").read_bytes()
    (run / "fig.png").unlink()
    pm.execute_notebook(NOTEBOOKS / "03_ablate.ipynb", tmp_path / "03b.ipynb", parameters={**params, "prune": False,
                        "models": ["not-a-model-because-nothing-is-loaded"]}, progress_bar=False, cwd=str(NOTEBOOKS))
    assert (run / "fig.png").stat().st_size > 10_000 and len(first) > 10_000
    assert pd.read_csv(run / "ablation.csv").equals(table)
