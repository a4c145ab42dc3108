"""Devices, tokenizers, the plan, sizes and dtypes: each refused or noted before a model is loaded.

Every case drives the command as a user types it (``spap`` in this process, as test_entry_points does) and
fails if the model is loaded first: ``sl.load`` is replaced by a recorder.
"""
from __future__ import annotations

import json

import pytest
import torch
from test_entry_points import TINY, refused, spap

import spap_lib as sl
from spap_lib.errors import ParameterError, surface
from spap_lib.plan import size


@pytest.fixture
def no_load(monkeypatch):
    """``sl.load`` that records a call and fails: a refusal must come before it."""
    calls = []

    def load(*a, **k):
        calls.append(a)
        raise AssertionError("the model was loaded before the refusal")
    monkeypatch.setattr(sl, "load", load)
    return calls


def _tiny(args: list[str], device: str) -> list[str]:
    cut = args.index("--device")
    return args[:cut] + ["--device", device] + args[cut + 2:]


@pytest.mark.parametrize("device,words", [("meta", ["cannot run a prune", "--device cpu"]),
                                          ("mps", ["MPS", "--device cpu"]),
                                          ("cuda:7", ["cuda:7"]),
                                          ("tpu", ["unknown device"])])
def test_a_device_that_cannot_run_a_prune_is_refused_before_loading(checkpoint, tmp_path, no_load, device, words):
    if device == "mps" and torch.backends.mps.is_available():
        pytest.skip("this machine has MPS")
    if device == "cuda:7" and torch.cuda.device_count() > 7:
        pytest.skip("this machine has eight GPUs")
    refused(spap("prune", checkpoint, "--out", tmp_path / "o", *_tiny(TINY, device)), *words)
    refused(spap("eval", checkpoint, *_tiny(TINY, device)[4:]), *words)
    assert not no_load


def _edit_tokenizer(folder, edit) -> None:
    path = folder / "tokenizer.json"
    blob = json.loads(path.read_text())
    edit(blob)
    path.write_text(json.dumps(blob))


def test_a_tokenizer_past_the_vocabulary_is_refused_naming_both_files(checkpoint, tmp_path, no_load):
    config = json.loads((checkpoint / "config.json").read_text())
    vocab = config["vocab_size"]

    def grow(blob):
        blob["model"]["vocab"][f"extra{vocab}"] = vocab + 5  # an id the embedding has no row for
    _edit_tokenizer(checkpoint, grow)
    refused(spap("prune", checkpoint, "--out", tmp_path / "o", *TINY), "tokenizer.json", "vocab_size",
            str(vocab + 5))
    refused(spap("eval", checkpoint, *TINY[4:]), "tokenizer.json", "not this model's")
    assert not no_load


def test_a_damaged_or_missing_tokenizer_is_named_as_such(checkpoint, tmp_path, no_load):
    path = checkpoint / "tokenizer.json"
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    refused(spap("eval", checkpoint, *TINY[4:]), str(path), "cut short")
    path.unlink()
    refused(spap("eval", checkpoint, *TINY[4:]), "vocabulary is missing", "save_pretrained")
    assert not no_load


@pytest.mark.parametrize("args,words", [(["--seqlen", "100000"], ["seqlen", "100000"]),
                                        (["--eval-seqlen", "100000"], ["--eval-seqlen"]),
                                        (["--sparsity", "0.999"], ["sparsity"]),
                                        (["--sparsity", "0.001"], ["sparsity"])])
def test_the_plan_refuses_what_the_prune_refuses(checkpoint, tmp_path, no_load, args, words):
    planned = refused(spap("plan", checkpoint, *args), *words)
    pruned = refused(spap("prune", checkpoint, "--out", tmp_path / "o", *TINY, *args), *words)
    first = lambda text: text.split(":")[1]  # noqa: E731 - the same refusal after "spap plan:" or "spap prune:"
    assert first(planned) == first(pruned)


def test_sizes_below_a_megabyte_are_not_zero():
    assert size(100 / 2**20) == "100 KB" and size(0.4 / 2**10) == "410 KB" and size(3.0) == "3.0 GB"
    assert size(1.5 / 2**10) == "1.5 MB" and size(12.5 / 2**10) == "12 MB" and size(1 / 2**30) == "0.00098 KB"


def test_refusals_name_out_as_the_caller_typed_it(checkpoint, tmp_path):
    (tmp_path / "o").write_text("a file")
    err = refused(spap("prune", checkpoint, "--out", tmp_path / "o", *TINY), "--out")
    assert "out_dir" not in err
    with surface("papermill"), pytest.raises(Exception, match="out_dir"):
        sl.artifact.manifest.check_out_dir(tmp_path / "o")


def test_a_method_that_saves_no_layers_refuses_a_resume_folder_up_front(checkpoint, tmp_path, no_load):
    err = refused(spap("prune", checkpoint, "--method", "slicegpt", "--resume-dir", tmp_path / "r",
                       "--out", tmp_path / "o", *TINY), "--resume-dir", "slicegpt")
    assert "resume_dir" not in err
    with pytest.raises(ParameterError, match="resume_dir"):
        sl.check_run(str(checkpoint), method="slicegpt", sparsity=0.2, resume_dir=tmp_path / "r")


@pytest.fixture
def half_checkpoint(tmp_path, tiny_tokenizer):
    from conftest import tiny_model

    path = tmp_path / "tiny-fp16"
    tiny_model("llama").half().save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


def _saved_dtypes(folder) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {str(f.get_slice(k).get_dtype()) for k in f.keys()}


def test_a_half_precision_source_is_saved_in_its_own_dtype_with_a_note(half_checkpoint, tmp_path):
    out = tmp_path / "o"
    result = spap("prune", half_checkpoint, "--method", "magnitude", "--out", out, *TINY)
    assert result.returncode == 0, result.stderr[-1500:]
    assert "computed in float32; saved as float16 (source float16 weights)" in result.stdout
    assert _saved_dtypes(out) == {"F16"}
    assert json.loads((out / "config.json").read_text())["dtype"] == "float16"
    kept = tmp_path / "o32"
    assert spap("prune", half_checkpoint, "--method", "magnitude", "--out", kept, "--save-dtype", "float32",
                *TINY).returncode == 0
    assert _saved_dtypes(kept) == {"F32"}


def test_an_unknown_save_dtype_is_refused(half_checkpoint, tmp_path, no_load):
    refused(spap("prune", half_checkpoint, "--out", tmp_path / "o", "--save-dtype", "int8", *TINY), "int8")
    assert not no_load


def test_missing_calibration_or_test_text_is_refused_before_loading(checkpoint, no_load, tmp_path, monkeypatch):
    """No WikiText-2 where ``SPAP_DATA_DIR`` points and no hub: ``spap prune`` names the file it looked for and the
    fix before the model is read (it used to find out after loading, at the calibration windows); ``--no-eval``
    needs the calibration text only."""
    monkeypatch.setenv("SPAP_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "out"
    refused(spap("prune", checkpoint, *TINY, "--out", out), "WikiText-2 train or validation split not found",
            "wiki.train.raw", "wiki.valid.raw", "SPAP_DATA_DIR")
    (tmp_path / "data" / "wikitext-2-raw-v1").mkdir(parents=True)
    (tmp_path / "data" / "wikitext-2-raw-v1" / "wiki.valid.raw").write_text(" = Valkyria = \n")
    refused(spap("prune", checkpoint, *TINY, "--out", out), "WikiText-2 test split not found", "wiki.test.raw")
    monkeypatch.delenv("HF_HUB_OFFLINE")  # a data directory that holds WikiText-2 is its one source: no hub asked
    refused(spap("prune", checkpoint, *TINY, "--out", out), "holds other splits but not", "wiki.test.raw")
    assert not no_load and not out.exists()
    with pytest.raises(AssertionError, match="the model was loaded"):  # every check passed: on to loading
        spap("prune", checkpoint, *TINY, "--out", out, "--no-eval")


def test_the_source_dtype_is_read_from_the_weights_not_the_config(tmp_path, tiny_checkpoint):
    """A config that says float16 over float32 weights: saved as float32, and the note says the config differs."""
    path = tiny_checkpoint()
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "dtype": "float16"}))
    out = tmp_path / "o"
    result = spap("prune", path, "--method", "magnitude", "--out", out, *TINY)
    assert result.returncode == 0, result.stderr[-1500:]
    assert "saved as float32 (source float32 weights; its config says float16)" in result.stdout
    assert _saved_dtypes(out) == {"F32"}


@pytest.mark.parametrize("qtype,dtype", [("F16", torch.float16), ("BF16", torch.bfloat16), ("F32", torch.float32),
                                         ("Q8_0", None)])
def test_a_ggufs_dtype_is_that_of_most_of_its_weights(tmp_path, qtype, dtype):
    """F16 and BF16 GGUFs are saved in their own dtype; a quantized one has none (saved in the working dtype). The
    float32 norms every GGUF holds do not decide it."""
    import gguf
    import numpy as np

    from spap_lib.model.dtypes import source_dtype
    from spap_lib.model.sources import ModelSource

    kind = gguf.GGMLQuantizationType[qtype]
    weight = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_down.weight", gguf.quantize(weight, kind), raw_dtype=kind)
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(256, dtype=np.float32))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    found, note = source_dtype(ModelSource("m", "gguf", str(tmp_path), "m.gguf"), config=None)
    assert found == dtype
    assert note == (f"GGUF {qtype}/F32, quantized" if dtype is None else f"{str(dtype)[6:]} GGUF")


@pytest.mark.parametrize("args,words", [(["--host-memory-gb", "-1"], ["--host-memory-gb must be"]),
                                        (["--device", "h100", "--device-memory-gb", "0"], ["--device-memory-gb"]),
                                        (["--nsamples", "0"], ["--nsamples must be"])])
def test_the_plan_names_the_flags_it_refuses(args, words):
    err = refused(spap("plan", "llama-3.1-8b", *args), *words)
    assert "_gb" not in err and "--world-size" not in err


def test_calibration_reads_the_data_directorys_validation_split_without_asking_the_hub(tmp_path, monkeypatch):
    import datasets

    from spap_lib.evaluation.data import calibration_text

    (tmp_path / "wikitext-2-raw-v1").mkdir()
    (tmp_path / "wikitext-2-raw-v1" / "wiki.valid.raw").write_text(" = Valkyria = \n")
    monkeypatch.setenv("SPAP_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("asked the hub"))
    assert calibration_text().split == "validation"


def test_a_pruned_checkpoint_is_not_pruned_again_whatever_layout_it_is_saved_in():
    """Any registered checkpoint format (per-layer widths, a sliced stream) is spap's already: refused by its own
    description, before any weight is read, and no method is named by the check."""
    from conftest import tiny_model

    from spap_lib.validate import check_config

    config = tiny_model("llama").config
    assert check_config("m", config, None, 0.2, {})[1] is not None  # a dense model is planned
    for marker, described in (("spap_mlp_widths", "per-layer MLP widths"), ("spap_slicing", "SliceGPT checkpoint")):
        marked = type(config).from_dict({**config.to_dict(), marker: [1]})
        with pytest.raises(ParameterError, match=f"already pruned: a .*{described}.*prune a dense model"):
            check_config("m", marked, None, 0.2, {})
