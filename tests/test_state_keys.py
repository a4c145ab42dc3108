"""State kept between runs is keyed by content and checked on the way back (docs/reliability.md).

A model replaced at the same path gets its own dense perplexity; a model moved to another path keeps its resume
folder; folders that cannot hold the finished layers are refused before the model is loaded; a full disk or a
read-only folder is one line naming the file.
"""
from __future__ import annotations

import errno
import json
import os

import pytest
from conftest import calibration
from test_entry_points import TINY, refused, spap

import spap_lib as sl
from spap_lib.errors import OutputError

FAST = ["--method", "fasp"]


def test_a_model_replaced_at_the_same_path_gets_its_own_dense_perplexity(tmp_path, tiny_tokenizer):
    from conftest import tiny_model

    path, cache = tmp_path / "model", tmp_path / "run" / "dense.json"
    tiny_model("llama", seed=0).save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    first = sl.dense_perplexity(sl.load(str(path), device="cpu"), 24, 2, cache=cache, progress=False)
    tiny_model("llama", seed=1).save_pretrained(path)  # new weights, same path, same config
    second = sl.dense_perplexity(sl.load(str(path), device="cpu"), 24, 2, cache=cache, progress=False)
    assert second["ppl"] != first["ppl"]
    again = sl.dense_perplexity(sl.load(str(path), device="cpu"), 24, 2, cache=cache, progress=False)
    assert again == second  # the same content: reused


def test_another_tokenizer_of_the_same_model_gets_its_own_calibration_and_dense_perplexity(tmp_path):
    """The same weights and tokenizer files, split otherwise in memory (as ``sl.load`` splits a GGUF's text as
    its model does): other ids, so the cached windows and dense perplexity are computed again, not reused."""
    from conftest import char_tokenizer, tiny_model
    from tokenizers import pre_tokenizers

    path, run = tmp_path / "model", tmp_path / "run"
    tiny_model("llama").save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    loaded = sl.load(str(path), device="cpu")
    calib = sl.get_calibration(loaded, 4, 16, 0, cache=run / "calibration.pt")
    dense = sl.dense_perplexity(loaded, 16, 2, cache=run / "dense.json", progress=False)
    assert sl.get_calibration(loaded, 4, 16, 0, cache=run / "calibration.pt").describe() == calib.describe()
    loaded.tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()  # words: unknown to a char vocab
    other = sl.get_calibration(loaded, 4, 16, 0, cache=run / "calibration.pt")
    assert other.describe()["sha256"] != calib.describe()["sha256"]
    assert sl.dense_perplexity(loaded, 16, 2, cache=run / "dense.json", progress=False) != dense


def test_a_saved_tokenizer_that_reloads_to_other_ids_is_not_installed(tmp_path, monkeypatch):
    """The tokenizer a checkpoint is saved with must reload (stock ``AutoTokenizer``, after the portable fields
    are written) to the ids the model was measured with; else nothing is installed."""
    from conftest import char_tokenizer, tiny_model
    from tokenizers import Tokenizer, pre_tokenizers

    from spap_lib.artifact import manifest
    from spap_lib.errors import CheckpointError
    from spap_lib.keys import tokenizer_digest

    path = tmp_path / "model"
    tiny_model("llama").save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    loaded = sl.load(str(path), device="cpu")
    report = sl.prune(loaded, sl.calibration_windows(loaded.tokenizer, 2, 16, 0), "magnitude", 0.25, progress=False)
    real = manifest.make_portable

    def rewritten(folder):  # a save step that changes how the written tokenizer splits text
        real(folder)
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.save(str(folder / "tokenizer.json"))

    monkeypatch.setattr(manifest, "make_portable", rewritten)
    with pytest.raises(CheckpointError, match="saved tokenizer does not reload to the ids"):
        sl.save(loaded, report, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    monkeypatch.setattr(manifest, "make_portable", real)
    checks = json.loads((sl.save(loaded, report, tmp_path / "out") / "spap_manifest.json").read_text())["checks"]
    assert checks["tokenizer_reloads"] and checks["tokenizer"] == tokenizer_digest(loaded.tokenizer)


def test_a_tokenizer_stock_loading_rebuilds_otherwise_is_refused_at_save(tmp_path, windows, tiny_tokenizer,
                                                                         byte_tokenizer):
    """transformers 5 reads a qwen2 checkpoint's tokenizer as ``Qwen2Tokenizer`` whatever class it was saved with: a
    word-level tokenizer comes back giving other ids, so the save is refused naming both classes; a byte-level
    BPE one (what Qwen2 models ship) is saved."""
    import torch
    from conftest import tiny_model

    from spap_lib.errors import CheckpointError
    from spap_lib.model.adapters import get_adapter
    from spap_lib.model.loading import Loaded
    from spap_lib.model.sources import ModelSource

    model = tiny_model("qwen2")
    loaded = Loaded(model, tiny_tokenizer, get_adapter(model), ModelSource("tiny-qwen2", "dir", "-"),
                    torch.device("cpu"))
    calib = calibration(windows)
    report = sl.prune(loaded, calib, "magnitude", 0.25, progress=False)
    with pytest.raises(CheckpointError, match="reads it as Qwen2Tokenizer, which gives .* where the "
                                              "TokenizersBackend gives"):
        sl.save(loaded, report, tmp_path / "word")
    assert not (tmp_path / "word").exists()
    loaded.tokenizer = byte_tokenizer
    assert json.loads((sl.save(loaded, report, tmp_path / "bpe") / "spap_manifest.json").read_text())["checks"][
        "tokenizer_reloads"]


def test_the_digest_record_is_never_trusted_for_other_content(tmp_path, monkeypatch):
    from spap_lib import keys

    monkeypatch.setenv("SPAP_CACHE_DIR", str(tmp_path / "cache"))
    big = tmp_path / "w.bin"
    big.write_bytes(b"a" * 4096)
    first = keys.file_digest(big, memo_above=1024)
    assert json.loads((tmp_path / "cache" / "digests.json").read_text())[str(big)]["sha256"] == first
    size = big.stat()
    big.write_bytes(b"b" * 4096)  # same size; a rewrite changes the times
    os.utime(big, ns=(size.st_atime_ns, size.st_mtime_ns))  # even with the old modification time restored
    assert keys.file_digest(big, memo_above=1024) == keys.sha256_of(big) != first


def _stopped_at_layer_0(source, out, folder, monkeypatch):
    from spap_lib.pipeline import resume

    real = resume.LayerCheckpoint.save

    def stop(self, i, *a, **k):
        real(self, i, *a, **k)
        if i == 0:
            raise KeyboardInterrupt
    monkeypatch.setattr(resume.LayerCheckpoint, "save", stop)
    with pytest.raises(KeyboardInterrupt):
        spap("prune", source, "--out", out, *FAST, *TINY, "--no-eval", "--resume-dir", folder)
    monkeypatch.setattr(resume.LayerCheckpoint, "save", real)


def test_a_prune_resumes_from_another_path_to_the_same_model(tiny_checkpoint, tmp_path, monkeypatch):
    source = tiny_checkpoint()
    folder = tmp_path / "progress"
    _stopped_at_layer_0(source, tmp_path / "o", folder, monkeypatch)
    monkeypatch.chdir(source.parent)  # the same folder, named relative to where the job is restarted
    result = spap("prune", source.name, "--out", tmp_path / "o", *FAST, *TINY, "--no-eval", "--resume-dir", folder)
    assert result.returncode == 0, result.stderr[-1500:]
    assert "resum" in (result.stdout + result.stderr).lower() and not folder.exists()


def test_another_models_resume_folder_shows_both_values(tiny_checkpoint, tmp_path, monkeypatch):
    from conftest import tiny_model

    source = tiny_checkpoint()
    folder = tmp_path / "progress"
    _stopped_at_layer_0(source, tmp_path / "o", folder, monkeypatch)
    tiny_model("llama", seed=3).save_pretrained(source)  # other weights at the same path
    err = refused(spap("prune", source, "--out", tmp_path / "o", *FAST, *TINY, "--no-eval", "--resume-dir", folder),
                  "another run", "model: \"sha256:")
    assert "there" in err and "now" in err


def test_another_calibration_size_or_world_size_is_refused_before_loading(tiny_checkpoint, tmp_path, monkeypatch):
    """The settings known before loading are compared up front, each named with both values: the calibration's
    size (its windows' digest needs the tokenizer) and the number of ranks."""
    source = tiny_checkpoint()
    folder = tmp_path / "progress"
    _stopped_at_layer_0(source, tmp_path / "o", folder, monkeypatch)
    calls = []
    monkeypatch.setattr(sl, "load", lambda *a, **k: calls.append(a))
    args = ["prune", source, "--out", tmp_path / "o", *FAST, *TINY, "--no-eval", "--resume-dir", folder]
    moved = [a if a != "4" else "8" for a in args]  # --nsamples 8
    refused(spap(*moved), "another run", "calibration.nsamples: 4 there, 8 now")
    state = json.loads((folder / "state.json").read_text())
    state["fingerprint"]["world_size"] = 2  # the folder of a 2-rank run
    (folder / "state.json").write_text(json.dumps(state))
    refused(spap(*args), "another run", "world_size: 2 there, 1 now")
    assert not calls


def test_the_resume_folder_and_out_may_not_overlap(tiny_checkpoint, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(sl, "load", lambda *a, **k: calls.append(a))
    source, out, folder = tiny_checkpoint(), tmp_path / "o", tmp_path / "r"
    for resume_dir, out_dir in ((out, out), (out / "progress", out), (folder, folder / "o")):
        refused(spap("prune", source, "--out", out_dir, *TINY, "--resume-dir", resume_dir),
                "--resume-dir", "--out", "overlap")
    assert not calls


def test_a_read_only_resume_folder_is_refused_before_loading(tiny_checkpoint, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(sl, "load", lambda *a, **k: calls.append(a))
    folder = tmp_path / "ro"
    folder.mkdir()
    real = os.access
    # root may write anywhere, so the permission the check reads is what is taken away
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(folder) else real(p, mode))
    refused(spap("prune", tiny_checkpoint(), "--out", tmp_path / "o", *TINY, "--resume-dir", folder),
            str(folder), "read-only")
    assert not calls


def test_a_full_disk_under_the_resume_folder_is_one_line_naming_it(tiny_checkpoint, tmp_path, monkeypatch):
    import safetensors.torch
    from safetensors import SafetensorError

    def full(*a, **k):  # what safetensors raises on a full disk: not an OSError
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    folder = tmp_path / "progress"
    refused(spap("prune", tiny_checkpoint(), "--out", tmp_path / "o", *FAST, *TINY, "--no-eval",
                 "--resume-dir", folder), str(folder), "cannot save layer 0", "free space")


def test_a_full_disk_under_a_run_folder_is_one_line_naming_the_file(tmp_path, monkeypatch):
    from pathlib import Path

    from spap_lib.files import write_json_atomic

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(OutputError, match=r"cannot write .*dense\.json \(the disk is full\)"):
        write_json_atomic(tmp_path / "dense.json", {"ppl": 1.0})
    assert list(tmp_path.iterdir()) == []  # no scratch file left behind


def test_a_cpu_prune_resumes_only_at_the_thread_count_it_started_with(tiny_checkpoint, tmp_path, monkeypatch):
    import torch

    source, folder = tiny_checkpoint(), tmp_path / "progress"
    _stopped_at_layer_0(source, tmp_path / "o", folder, monkeypatch)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)  # CPU reductions split by thread: other bits
    try:
        refused(spap("prune", source, "--out", tmp_path / "o", *FAST, *TINY, "--no-eval", "--resume-dir", folder),
                "threads", f"{threads} there, {threads + 1} now")
    finally:
        torch.set_num_threads(threads)
