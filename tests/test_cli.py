"""The ``spap`` command line: the notebook's prune, plan and evaluation behind three subcommands."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from spap_lib.cli import main

TINY = ["--nsamples", "4", "--seqlen", "24", "--eval-seqlen", "24", "--eval-windows", "3",
        "--hparams", '{"K": 3, "am_iters": 1, "adam_steps": 2}', "--device", "cpu"]


def test_prune_writes_the_notebooks_checkpoint_and_eval_reads_it(checkpoint, tmp_path, capsys):
    out = tmp_path / "pruned"
    (checkpoint / "README.md").write_text("---\nlicense: mit\n---\nA tiny model.\n")  # its license is carried over
    assert main(["prune", str(checkpoint), "--sparsity", "0.25", "--out", str(out), *TINY]) == 0
    printed = capsys.readouterr().out
    assert "remove " in printed  # the check's summary (and plan) first, then the result as JSON
    result = json.loads(printed[printed.index("\n{\n") + 1:])
    assert result["out_dir"] == str(out)
    assert result["method"] == "spap" and result["calibration"]["nsamples"] == 4
    assert (out / "config.json").is_file() and (out / "spap_manifest.json").is_file()
    manifest = json.loads((out / "spap_manifest.json").read_text())
    assert manifest["checks"]["reload_max_abs_diff"] <= 1e-4
    assert result["reload_max_abs_diff"] == manifest["checks"]["reload_max_abs_diff"]  # 02's prune_result fields
    pruned_ppl = result["perplexity"]["pruned"]["ppl"]
    assert main(["eval", str(out), "--eval-seqlen", "24", "--eval-windows", "3", "--device", "cpu"]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    assert evaluated["ppl"] == pytest.approx(pruned_ppl, rel=1e-5) and evaluated["windows"] == 3
    _check_card(out / "README.md", checkpoint, pruned_ppl, manifest)
    # the same out again without --overwrite: refused before any work, with the fix
    assert main(["prune", str(checkpoint), "--sparsity", "0.25", "--out", str(out), *TINY]) == 2
    assert "overwrite" in capsys.readouterr().err


def _check_card(path: Path, source: Path, pruned_ppl: float, manifest: dict) -> None:
    """The model card in the Hub's conventions: front matter for the index, then what was done, measured, run, and
    how to load it; ``spap eval`` added its row."""
    import yaml

    card = path.read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert front["base_model"] == str(source) and front["library_name"] == "transformers"
    assert {"pruned", "spap"} <= set(front["tags"]) and front["license"] == "mit"
    assert front["datasets"] == ["Salesforce/wikitext"]
    assert f"pruned {pruned_ppl:.2f}" in card and f"sha256 `{manifest['calibration']['sha256']}`" in card
    assert f"`spap prune {source} --sparsity 0.25" in card and "AutoModelForCausalLM.from_pretrained" in card
    assert manifest["git_revision"] is None or manifest["git_revision"] in card
    evaluations = card[card.index("## Evaluations"):]
    assert f"`spap eval {path.parent}" in evaluations and f"{pruned_ppl:.4g}" in evaluations


@pytest.mark.parametrize("args, message", [
    (["--sparsity", "1.5"], "sparsity"),
    (["--offload", "gpu"], "unknown offload 'gpu': use one of auto, none, cpu, disk"),
    (["--method", "nope"], "unknown method"),
])
def test_bad_input_is_one_clear_line(checkpoint, tmp_path, capsys, args, message):
    assert main(["prune", str(checkpoint), "--out", str(tmp_path / "o"), *TINY, *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spap prune: ") and message in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_a_bad_bf16_kernel_choice_is_one_clear_line_before_any_work(checkpoint, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPAP_BF16_PRODUCTS", "fast")
    assert main(["prune", str(checkpoint), "--out", str(tmp_path / "o"), *TINY]) == 2
    err = capsys.readouterr().err
    assert "SPAP_BF16_PRODUCTS='fast': choose one of auto, native, rounded" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_plan_prints_the_table_for_any_target(capsys):
    assert main(["plan", "llama-3.1-8b", "--device", "rtx4090"]) == 0
    table = capsys.readouterr().out
    assert "llama-3.1-8b" in table and "rtx4090" in table and "offload" in table
    assert main(["plan", "--list"]) == 0
    assert "qwen2.5-72b" in capsys.readouterr().out


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "spap"
    if not script.exists():
        pytest.skip("package not installed with its entry points (make setup installs it)")
    out = subprocess.run([str(script), "--help"], capture_output=True, text=True, check=True).stdout
    assert "spap prune MODEL" in out and "plan" in out and "eval" in out
