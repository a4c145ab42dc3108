"""Nothing silently wrong on any entry point: the ``spap`` command, safetensors sources, resume folders,
full disks. The command is the surface, so most cases run it as a subprocess: a user error is one line
on stderr and exit status 2, before any weight is read; never exit 0 with a wrong result."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import spap_lib as sl
from spap_lib.cli import main
from spap_lib.errors import OutputError, ParameterError, SourceError, SpapError, surface

TINY = ["--nsamples", "4", "--seqlen", "24", "--eval-seqlen", "24", "--eval-windows", "2", "--device", "cpu"]


def spap(*args: str) -> subprocess.CompletedProcess:
    """The command's ``main`` as the ``spap`` script runs it, in this process (a fresh interpreter per case would
    spend most of its time importing torch): its exit status and what it printed. ``spap_process`` runs the real
    script, for the cases where the process itself is what is tested."""
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([str(a) for a in args])
        except SystemExit as exit_:  # argparse's own refusals
            code = exit_.code
    return subprocess.CompletedProcess(["spap", *map(str, args)], code, out.getvalue(), err.getvalue())


def spap_process(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spap_lib.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def refused(result: subprocess.CompletedProcess, *words: str) -> str:
    """Exit 2, one line on stderr naming ``words``, no traceback."""
    err = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and len([line for line in err if line.startswith("spap ")]) == 1
    for word in words:
        assert word in result.stderr, (word, result.stderr)
    return result.stderr


def _edit_weights(path: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


# -- every source is checked before any work ------------------------------------------------------

def test_a_checkpoint_missing_a_tensor_is_refused_by_every_command_and_offload(checkpoint, tmp_path):
    _edit_weights(checkpoint, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    name = "model.layers.1.mlp.up_proj.weight"
    refused(spap_process("eval", checkpoint, *TINY[4:]), "missing", name)  # the installed entry point's own process
    refused(spap("prune", checkpoint, "--method", "magnitude", "--out", tmp_path / "o", *TINY), name)
    refused(spap("prune", checkpoint, "--method", "magnitude", "--offload", "disk", "--out", tmp_path / "o", *TINY),
            name)
    assert not (tmp_path / "o").exists()
    with pytest.raises(SourceError, match="missing"):  # the library too: never a random initialisation
        sl.load(str(checkpoint), device="cpu")


def test_truncated_misshapen_extra_and_absent_weights_are_named(checkpoint, tmp_path):
    weights = checkpoint / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 100])
    refused(spap("eval", checkpoint, *TINY[4:]), "truncated", "model.safetensors")
    weights.write_bytes(data)

    def widen(t):
        t["model.layers.0.mlp.down_proj.weight"] = torch.zeros(32, 80)
    _edit_weights(checkpoint, widen)
    refused(spap("eval", checkpoint, *TINY[4:]), "shape", "model.layers.0.mlp.down_proj.weight", "[32, 64]")
    weights.write_bytes(data)
    _edit_weights(checkpoint, lambda t: t.update({"model.layers.7.mlp.up_proj.weight": torch.zeros(64, 32)}))
    refused(spap("eval", checkpoint, *TINY[4:]), "does not use", "model.layers.7")
    weights.unlink()
    refused(spap("eval", checkpoint, *TINY[4:]), "no weights")
    index = {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    refused(spap("eval", checkpoint, *TINY[4:]), "lacks shard", "model-00001-of-00002.safetensors")


def test_a_tying_config_over_a_head_of_its_own_is_refused(checkpoint, tmp_path):
    """transformers 4.x ties the head to the embeddings as the config says, 5.x loads the head the file holds: two
    models from one checkpoint. A stored head equal to the embeddings is the same model either way."""
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    _edit_weights(checkpoint, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    assert spap("eval", checkpoint, *TINY[4:]).returncode == 0
    _edit_weights(checkpoint, lambda t: t.update({"lm_head.weight": t["lm_head.weight"] + 0.01}))
    refused(spap("prune", checkpoint, "--out", tmp_path / "o", *TINY), "tie_word_embeddings", "lm_head.weight",
            "differs from model.embed_tokens.weight")
    assert not (tmp_path / "o").exists()


def test_a_complete_checkpoint_of_every_architecture_passes_the_check(arch, tmp_path):
    from conftest import tiny_model

    from spap_lib.model.loading import check_source_weights
    from spap_lib.model.sources import ModelSource

    tiny_model(arch).save_pretrained(tmp_path / arch)
    check_source_weights(ModelSource(arch, "dir", str(tmp_path / arch)))  # no false alarm (tied heads, OPT names)


def test_an_unreachable_hub_id_in_plan_is_one_line():
    refused(spap("plan", "no-such-org/no-such-model"), "no-such-org/no-such-model")


# -- everything knowable up front is checked up front ---------------------------------------------

@pytest.mark.parametrize("out, words", [("", ["names no new folder", "--out pruned"]),
                                        (".", ["names no new folder"])])
def test_an_unusable_out_is_refused_before_loading(checkpoint, out, words):
    refused(spap("prune", checkpoint, "--out", out, *TINY), *words)


def test_round_to_that_removes_nothing_is_refused_and_sparsity_zero_keeps_the_model(checkpoint, tmp_path, windows):
    refused(spap("prune", checkpoint, "--round-to", "1000", "--out", tmp_path / "o", *TINY),
            "removes no MLP channel", "--round-to")
    loaded = sl.load(str(checkpoint), device="cpu")
    before = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    from spap_lib.evaluation.data import Calibration

    report = sl.prune(loaded, Calibration(windows, torch.arange(4), "validation", "t", 10_000, 0), "spap", 0.0,
                      progress=False)
    after = loaded.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # not even the refit of down_proj
    assert report["sparsity"]["achieved_decoder"] == 0 and report["seconds"] == 0 and report["layers"] == []


def test_a_full_disk_is_found_before_the_prune_with_the_flag_to_change(checkpoint, tmp_path, monkeypatch, capsys):
    import spap_lib.validate as api

    real = shutil.disk_usage
    monkeypatch.setattr(api.shutil, "disk_usage", lambda p: real(p)._replace(free=1024))
    called = []
    monkeypatch.setattr(sl, "load", lambda *a, **k: called.append(1))
    assert main(["prune", str(checkpoint), "--out", str(tmp_path / "o"), "--offload", "none", *TINY]) == 2
    err = capsys.readouterr().err
    assert "the pruned checkpoint needs about 120 KB" in err and "has 1 KB free" in err and "--out" in err
    assert not called


def test_resume_dir_is_checked_before_loading(checkpoint, tmp_path):
    folder = tmp_path / "r"
    folder.write_text("a file")
    refused(spap("prune", checkpoint, "--resume-dir", folder, "--out", tmp_path / "o", *TINY), "is a file")
    folder.unlink()
    folder.mkdir()
    (folder / "state.json").write_text('{"version": 3}')
    refused(spap("prune", checkpoint, "--resume-dir", folder, "--out", tmp_path / "o", *TINY), "spap did not write")
    (folder / "state.json").write_text('{"fingerprint": ')
    refused(spap("prune", checkpoint, "--resume-dir", folder, "--out", tmp_path / "o", *TINY),
            str(folder / "state.json"))
    # another run's layers: refused in check_run, from the config alone (no load, no calibration)
    (folder / "state.json").write_text(json.dumps({"fingerprint": {"model": str(checkpoint), "method": "fasp"},
                                                   "next": 1, "hidden": {}}))
    with pytest.raises(ParameterError, match="another run.*method"):
        sl.check_run(str(checkpoint), method="spap", sparsity=0.2, resume_dir=folder)


def test_a_first_commit_cut_short_is_restarted_not_refused(checkpoint, tmp_path, windows):
    from spap_lib.evaluation.data import Calibration
    from spap_lib.pipeline.resume import check_folder

    folder = tmp_path / "r"
    folder.mkdir()
    (folder / ".layer_000.tmp").write_bytes(b"half")  # killed inside the first layer's save
    assert check_folder(folder) == "restart"
    loaded = sl.load(str(checkpoint), device="cpu")
    report = sl.prune(loaded, Calibration(windows, torch.arange(4), "validation", "t", 10_000, 0), "fasp", 0.25,
                      progress=False, resume_dir=folder)
    assert report["resumed_at_layer"] == 0 and not folder.exists()  # done: its files cleared


# -- messages speak the caller's language ---------------------------------------------------------

def test_the_existing_checkpoint_refusal_names_the_callers_flag(checkpoint, tmp_path):
    out = tmp_path / "o"
    assert spap("prune", checkpoint, "--method", "magnitude", "--no-eval", "--out", out, *TINY).returncode == 0
    refused(spap("prune", checkpoint, "--method", "magnitude", "--no-eval", "--out", out, *TINY), "pass --overwrite")
    for where, text in (("papermill", "-p overwrite True"), ("python", "overwrite=True")):
        with surface(where), pytest.raises(OutputError, match=text):
            sl.artifact.manifest.check_out_dir(out)


def test_malformed_hparams_quote_the_text(checkpoint, tmp_path):
    result = spap("prune", checkpoint, "--hparams", "{K: 3}", "--out", tmp_path / "o", *TINY)
    assert result.returncode == 2 and "'{K: 3}' is not JSON" in result.stderr and "Traceback" not in result.stderr


def test_no_eval_does_not_check_the_evaluation_window(checkpoint, tmp_path):
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    args = ["prune", checkpoint, "--method", "magnitude", "--nsamples", "4", "--seqlen", "24", "--device", "cpu",
            "--out", tmp_path / "o"]
    refused(spap(*args), "--eval-seqlen 2048")  # the default window of the paper's protocol does not fit
    assert spap(*args, "--no-eval").returncode == 0


def test_debug_keeps_the_traceback_and_real_bugs_keep_theirs(checkpoint, tmp_path, monkeypatch):
    with pytest.raises(SpapError):
        main(["--debug", "prune", str(checkpoint), "--round-to", "1000", "--out", str(tmp_path / "o"), *TINY])
    monkeypatch.setattr(sl, "check_run", lambda *a, **k: {}["bug"])
    with pytest.raises(KeyError):  # not a user error: not turned into a one-liner
        main(["prune", str(checkpoint), "--out", str(tmp_path / "o"), *TINY])


def test_round_to_by_format_name_prunes_to_its_block_and_the_card_says_what_a_width_costs(checkpoint, tmp_path,
                                                                                          monkeypatch):
    refused(spap("prune", checkpoint, "--round-to", "q7_k", "--out", tmp_path / "o", *TINY), "--round-to", "q4_k_m")
    odd = spap("prune", checkpoint, "--method", "magnitude", "--sparsity", "0.2", "--out", tmp_path / "odd", *TINY)
    assert odd.returncode == 0, odd.stderr
    assert "not a multiple of 32" in odd.stdout and "--round-to q8_0" in odd.stdout  # before the prune: the summary
    assert "round_to auto: the method's own widths (auto rounds to 32 an MLP of 512" in odd.stdout  # a tiny MLP
    assert "not a multiple of 32" in (tmp_path / "odd" / "README.md").read_text()
    named = spap("prune", checkpoint, "--method", "magnitude", "--sparsity", "0.2", "--round-to", "q8_0",
                 "--out", tmp_path / "named", *TINY)
    assert named.returncode == 0, named.stderr
    assert "round_to 32: kept width 32" in named.stdout and "not of 256" in named.stdout
    manifest = json.loads((tmp_path / "named" / "spap_manifest.json").read_text())
    assert manifest["sparsity"]["round_to"] == 32 and manifest["sparsity"]["mlp_width"]["pruned"] == 32
    assert manifest["sparsity"]["achieved_decoder"] > 0.2  # the nearest multiple of 32 to the 20% width


def test_the_share_printed_before_a_prune_is_the_one_it_achieves(checkpoint, tmp_path):
    """FLAP adds bias slots to a model without them: the share removed, printed before the run, is net of them."""
    import re

    result = spap("prune", checkpoint, "--method", "flap", "--round-to", "8", "--out", tmp_path / "o", *TINY)
    assert result.returncode == 0, result.stderr[-2000:]
    printed = float(re.search(r"([\d.]+)% of the decoder's parameters removed", result.stdout)[1])
    achieved = json.loads((tmp_path / "o" / "spap_manifest.json").read_text())["sparsity"]["achieved_decoder"]
    assert printed == pytest.approx(100 * achieved, abs=0.005)


def test_wikitext_that_is_not_utf8_is_one_line_naming_the_byte_before_loading(checkpoint, tmp_path, monkeypatch):
    from conftest import DATA

    from spap_lib.evaluation.data import SPLIT_FILES, WIKITEXT

    folder = tmp_path / "data" / WIKITEXT
    folder.mkdir(parents=True)
    for name in SPLIT_FILES.values():
        if (DATA / WIKITEXT / name).is_file():
            (folder / name).write_bytes((DATA / WIKITEXT / name).read_bytes()[:20000] + b"\n caf\xe9 \n")
    monkeypatch.setenv("SPAP_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setattr(sl, "load", lambda *a, **k: pytest.fail("loaded before the data were checked"))
    for command in (("eval", checkpoint, *TINY[4:]), ("prune", checkpoint, "--out", tmp_path / "o", *TINY)):
        refused(spap(*command), "is not UTF-8 text", "byte 0xe9")


def test_an_out_path_with_dot_dots_is_the_folder_it_names_and_leaves_nothing_on_the_way(checkpoint, tmp_path,
                                                                                      monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert spap("prune", checkpoint, "--out", "o/q3/x/../../q3", *TINY).returncode == 0
    assert spap("prune", checkpoint, "--out", "o/q1/../q2", *TINY).returncode == 0
    assert sorted(p.name for p in (tmp_path / "o").iterdir() if not p.name.startswith(".")) == ["q2", "q3"]
    assert (tmp_path / "o/q3/spap_manifest.json").is_file()
