"""Models and data as users hold them: a Hugging Face hub cache (``HF_HOME``) laid out as huggingface_hub writes it,
half-precision sharded safetensors of every architecture, read with ``HF_HUB_OFFLINE=1`` and no data directory.

Every entry point runs on it: ``spap prune`` at every offload (saved in the source's dtype, stock-loaded), ``spap
eval``, ``spap plan``, ``sl.load``, the notebooks 01 to 05 and the design card's command. WikiText-2 comes from the
cache's ``Salesforce/wikitext`` dataset repo.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import papermill as pm
import pytest
import torch
from conftest import ARCHS, DATA, HALF, use_hub_home
from hubcache import add_model
from safetensors.torch import load_file, save_file
from test_cli import TINY
from test_entry_points import refused, spap
from test_notebooks import CHAIN, NOTEBOOKS, smoke

import spap_lib as sl
from spap_lib.artifact.checkpoint import reload_tolerance
from spap_lib.model.dtypes import stored_dtypes
from spap_lib.model.sources import ModelSource

STORED = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
MODES = ("none", "cpu", "disk")


def _layout(snapshot: Path) -> None:
    """What the fixture built is the hub's layout: relative symlinks into blobs, shards and their index."""
    index = json.loads((snapshot / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    for f in snapshot.iterdir():
        assert f.is_symlink() and f.resolve().parent.name == "blobs"


def _tensors(folder: Path) -> dict:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("arch", ARCHS)
def test_every_offload_prunes_a_half_precision_hub_checkpoint_and_saves_it_in_its_dtype(offline_hub, short_text,
                                                                                       monkeypatch, tmp_path, arch,
                                                                                       dtype):
    from huggingface_hub import snapshot_download
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("SPAP_DATA_DIR", str(short_text))
    repo = f"tiny-org/{arch}-{dtype}"
    _layout(Path(snapshot_download(repo, local_files_only=True)))
    saved = {}
    for mode in MODES:
        out = tmp_path / mode
        result = spap("prune", repo, "--out", out, "--offload", mode, *TINY)
        assert result.returncode == 0, result.stderr[-2000:]
        assert f"saved as {dtype} (source {dtype} weights)" in result.stdout
        assert set(stored_dtypes(ModelSource(str(out), "dir", str(out)))[0]) == {STORED[dtype]}
        assert json.loads((out / "config.json").read_text())["dtype"] == dtype
        checks = json.loads((out / "spap_manifest.json").read_text())["checks"]
        assert checks["saved_dtype"] == dtype and checks["reloaded_dtype"] == "float32"
        assert checks["reload_max_abs_diff"] <= checks["reload_tolerance"]
        stock = AutoModelForCausalLM.from_pretrained(out)  # as users load it: in the dtype it was saved in
        assert stock.dtype == HALF[dtype]
        with torch.no_grad():
            assert torch.isfinite(stock(input_ids=torch.arange(16)[None]).logits).all()
        saved[mode] = _tensors(out)
    for mode in MODES[1:]:  # one model, whatever the offload: the same tensors, bit for bit
        assert saved[mode].keys() == saved["none"].keys()
        assert all(torch.equal(saved[mode][k], v) for k, v in saved["none"].items()), mode


def _changed_after_writing(monkeypatch):
    """``sl.save``'s writer followed by one weight changed by 5% in the written files: a checkpoint that differs from
    the model in memory."""
    from spap_lib.artifact import checkpoint

    real = checkpoint.save_pruned

    def save_pruned(write, *args, **kwargs):
        def write_then_change(tmp):
            write(tmp)
            for f in sorted(Path(tmp).glob("*.safetensors")):
                tensors = load_file(f)
                name = next((n for n in tensors if n.endswith(("down_proj.weight", "fc2.weight"))), None)
                if name is not None:
                    tensors[name] = tensors[name] * 1.05
                    save_file(tensors, str(f) + ".new", metadata={"format": "pt"})
                    os.replace(str(f) + ".new", f)  # a new file: a hard-linked spill keeps the pruned values
                    return
        return real(write_then_change, *args, **kwargs)
    monkeypatch.setattr(checkpoint, "save_pruned", save_pruned)


@pytest.mark.parametrize("mode", ["none", "disk"])
def test_a_checkpoint_that_reloads_to_another_model_is_refused_with_the_fix(offline_hub, short_text, tmp_path,
                                                                            monkeypatch, mode):
    monkeypatch.setenv("SPAP_DATA_DIR", str(short_text))
    _changed_after_writing(monkeypatch)
    out = tmp_path / "o"
    result = spap("prune", "tiny-org/llama-bfloat16", "--out", out, "--offload", mode, *TINY)
    err = result.stderr.strip().splitlines()[-1]  # after the progress bars: the refusal, one line
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    for words in ("does not reload to the same model", "tolerance for float32 logits", "--save-dtype float32",
                  "--resume-dir"):
        assert words in err, err
    assert not out.exists()


def test_reload_tolerance_grows_with_the_logits_and_the_dtype():
    assert reload_tolerance(torch.float32, 0.5) == 1e-4
    assert reload_tolerance(torch.float32, 30.0) == pytest.approx(3e-4)
    assert reload_tolerance(torch.bfloat16, 30.0) == pytest.approx(2 * 2 ** -7 * 30)  # two bf16 steps at 30
    assert reload_tolerance(torch.float16, 0.5) == pytest.approx(2 * 2 ** -10)


def test_eval_plan_and_load_read_the_hub_cache(offline_hub, tmp_path):
    repo = "tiny-org/gemma3-bfloat16"
    result = spap("eval", repo, "--eval-seqlen", "24", "--eval-windows", "2", "--device", "cpu")
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout)["ppl"] > 1
    result = spap("plan", repo, "--nsamples", "4", "--seqlen", "24", "--device", "cpu-2core")
    assert result.returncode == 0, result.stderr[-2000:]
    for mode in MODES:
        loaded = sl.load(repo, device="cpu", offload=mode, spill_dir=tmp_path)
        assert loaded.source.kind == "hub" and loaded.model.dtype == torch.float32  # computed in float32 on a CPU
        loaded.onloader.close()


def test_the_python_api_saves_a_hub_checkpoint_in_its_dtype(offline_hub, short_text, tmp_path, monkeypatch):
    """``sl.prune`` then ``sl.save``, with no dtype in the report: the source's bfloat16, as ``spap prune`` saves."""
    monkeypatch.setenv("SPAP_DATA_DIR", str(short_text))
    loaded = sl.load("tiny-org/qwen2-bfloat16", device="cpu")
    report = sl.prune(loaded, sl.get_calibration(loaded, 4, 24, 0), "magnitude", 0.25)
    out = sl.save(loaded, report, tmp_path / "o")
    assert set(stored_dtypes(ModelSource(str(out), "dir", str(out)))[0]) == {"BF16"}
    checks = json.loads((out / "spap_manifest.json").read_text())["checks"]
    assert checks["saved_dtype"] == "bfloat16" and checks["reload_max_abs_diff"] <= checks["reload_tolerance"]


def test_the_data_come_from_the_hub_cache_and_are_the_data_directorys_text(offline_hub, monkeypatch):
    from spap_lib.evaluation.data import check_available, wikitext

    cached, test = wikitext("validation"), wikitext("test")
    assert cached.source.startswith("hub:Salesforce/wikitext/wikitext-2-raw-v1@") and test.source.startswith("hub:")
    monkeypatch.setenv("SPAP_DATA_DIR", str(DATA))
    assert wikitext("validation").text == cached.text  # the cache's test split holds its first rows (hub_home)
    assert wikitext("test").text.startswith(test.text)
    check_available(calibration=True, evaluation=True)


def test_without_the_data_in_the_cache_a_run_is_refused_naming_both_places(offline_hub, tmp_path, monkeypatch):
    from spap_lib.evaluation import data

    monkeypatch.setattr(data, "HUB_DATASET", "nobody/no-such-dataset")
    refused(spap("prune", "tiny-org/llama-bfloat16", "--out", tmp_path / "o", *TINY),
            "WikiText-2", "SPAP_DATA_DIR", "HF_HOME", "nobody/no-such-dataset", "not tried: HF_HUB_OFFLINE=1")


@pytest.mark.slow
def test_the_notebooks_run_from_the_hub_cache(offline_hub, short_text, tmp_path, monkeypatch):
    """01 to 03, which read the model by its hub id, on a bf16 hub checkpoint (smoke settings; 03 with two
    methods); text from a data directory (the text read from the cache: the next test). 04 and 05 load the dense
    model through the same ``sl.load`` and read 02's folder: the smoke chain runs them."""
    monkeypatch.setenv("SPAP_DATA_DIR", str(short_text))
    run, repo = tmp_path / "run", "tiny-org/qwen2-bfloat16"
    for nb in CHAIN[:3]:
        params = smoke(nb, run_dir=str(run))
        own = {"model": repo}
        params.update({k: v for k, v in own.items() if k in params})
        params.update({"models": [repo], "methods": ["magnitude", "fasp"]} if nb.startswith("03") else {})
        pm.execute_notebook(NOTEBOOKS / nb, tmp_path / nb, parameters=params, progress_bar=False,
                            cwd=str(NOTEBOOKS))
    assert set(stored_dtypes(ModelSource("p", "dir", str(run / "pruned")))[0]) == {"BF16"}


@pytest.mark.slow
def test_the_design_cards_command_runs_from_an_offline_hub_cache(offline_hub, tmp_path):
    """``papermill notebooks/02_prune.ipynb out.ipynb -p model qwen2.5-0.5b``, the paper's settings, on a cache
    holding ``Qwen/Qwen2.5-0.5B`` (a tiny qwen2 there), no data directory: the alias reads the cache, the text too."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "SPAP_DATA_DIR"}
    run = subprocess.run([sys.executable, "-m", "papermill", str(NOTEBOOKS / "02_prune.ipynb"),
                          str(tmp_path / "out.ipynb"), "-p", "model", "qwen2.5-0.5b",
                          "-p", "run_dir", str(tmp_path / "run")], env=env, capture_output=True, text=True,
                         timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "run" / "prune_result.json").read_text())
    assert result["model"] == "qwen2.5-0.5b" and result["calibration"]["source"].startswith("hub:Salesforce")
    assert set(stored_dtypes(ModelSource("p", "dir", str(tmp_path / "run" / "pruned")))[0]) == {"BF16"}


@pytest.mark.slow
@pytest.mark.parametrize("alias", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_a_real_models_weights_saved_in_bfloat16_pass_the_reload_check(alias, short_text, tmp_path, monkeypatch):
    """An offline model's real weights as a bf16 hub checkpoint, pruned on the CPU (in float32) and saved in bf16:
    logits of real magnitude, which one bf16 step of a tiny model's never reaches. Resident and streamed."""
    from conftest import offline_model

    offline_model(alias)  # skipped, with the install command, where it is not installed
    loaded = sl.load(alias, device="cpu")
    add_model(tmp_path / "hf" / "hub", f"real/{alias}", loaded.model, loaded.tokenizer, torch.bfloat16,
              max_shard_size="200MB")
    del loaded
    use_hub_home(tmp_path / "hf", tmp_path, monkeypatch)
    monkeypatch.setenv("SPAP_DATA_DIR", str(short_text))
    for mode in ("none", "disk"):
        out = tmp_path / mode
        result = spap("prune", f"real/{alias}", "--method", "wanda_sp", "--out", out, "--offload", mode, "--no-eval",
                      "--nsamples", "2", "--seqlen", "64", "--device", "cpu")
        assert result.returncode == 0, result.stderr[-2000:]
        checks = json.loads((out / "spap_manifest.json").read_text())["checks"]
        assert checks["saved_dtype"] == "bfloat16" and checks["reload_max_abs_diff"] <= checks["reload_tolerance"]
        assert set(stored_dtypes(ModelSource(str(out), "dir", str(out)))[0]) == {"BF16"}
