"""Bad input fails early with an error that names the problem and the fix."""
import pytest
import torch

import spap_lib as sl
from spap_lib.evaluation.data import Calibration
from spap_lib.files import atomic_dir


@pytest.mark.parametrize("sparsity", [-0.1, 1.0, 1.5, "0.2", float("nan")])
def test_sparsity_outside_unit_interval(loaded, sparsity):
    with pytest.raises(ValueError, match=r"sparsity must be a fraction in \[0, 1\)"):
        sl.plan_sparsity(loaded.adapter, sparsity)


def test_sparsity_so_high_no_channel_remains(loaded):
    with pytest.raises(ValueError, match="would remove all .* Choose a lower sparsity"):
        sl.plan_sparsity(loaded.adapter, 0.95)


def test_unknown_method_lists_registered(loaded, windows):
    with pytest.raises(ValueError, match="unknown method 'nope'.*spap"):
        sl.prune(loaded, Calibration(windows, torch.arange(len(windows)), "v", "s", 1, 0), "nope", 0.2)
    with pytest.raises(ValueError, match="unknown hyperparameter"):
        sl.get_method("spap", rho=3)


def test_unknown_model_lists_aliases():
    with pytest.raises(ValueError, match="unknown model 'not-a-model'.*smollm2-135m"):
        sl.resolve("not-a-model")


def test_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="without config.json"):
        sl.resolve(str(tmp_path))


def test_aliases_resolve_without_network():
    assert sl.resolve("qwen2.5-0.5b").path == "Qwen/Qwen2.5-0.5B"
    assert sl.resolve("opt-125m").path == "facebook/opt-125m"
    src = sl.resolve("smollm2-135m")
    assert src.kind == "gguf" and src.gguf_file.endswith(".gguf")


def test_unsupported_architecture_names_supported_ones():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'.*llama.*opt"):
        sl.get_adapter(model)


def test_too_few_calibration_tokens(tiny_tokenizer):
    text = sl.evaluation.data.Text(" ".join(f"w{i % 100 + 1}" for i in range(500)), "validation", "fixture")
    with pytest.raises(ValueError, match="too few calibration tokens: 4 x 200 = 800 .* has 500 tokens"):
        sl.calibration_windows(tiny_tokenizer, 4, 200, text=text)
    calib = sl.calibration_windows(tiny_tokenizer, 4, 100, seed=7, text=text)
    assert calib.windows.shape == (4, 100)
    assert torch.equal(calib.windows, sl.calibration_windows(tiny_tokenizer, 4, 100, seed=7, text=text).windows)


def test_without_spap_data_dir_the_data_directory_is_the_checkouts_data_folder(monkeypatch):
    """data/README.md: ``$SPAP_DATA_DIR`` if set, else the checkout's data/ (where that README is)."""
    monkeypatch.delenv("SPAP_DATA_DIR", raising=False)
    assert (sl.data_dir() / "README.md").is_file() and sl.data_dir() == sl.REPO / "data"


def test_missing_data_directory_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("SPAP_DATA_DIR", str(tmp_path / "nowhere"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError, match="nowhere.*Set SPAP_DATA_DIR"):
        sl.wikitext("test")


def test_calibration_falls_back_to_validation_and_says_so():
    if not (sl.data_dir() / "wikitext-2-raw-v1" / "wiki.valid.raw").is_file():
        pytest.skip("no WikiText-2 validation split in SPAP_DATA_DIR")
    text = sl.evaluation.data.calibration_text()
    if not (sl.data_dir() / "wikitext-2-raw-v1" / "wiki.train.raw").is_file():
        assert text.split == "validation" and "wiki.valid.raw" in text.source


def test_wikitext_test_split_matches_published_recipe():
    path = sl.data_dir() / "wikitext-2-raw-v1" / "wiki.test.raw"
    if not path.is_file():
        pytest.skip("no WikiText-2 test split in SPAP_DATA_DIR")
    text = sl.wikitext("test").text
    assert len(sl.evaluation.data.read_raw(path)) == 4358 and text.count("\n") == 11605


def test_failed_write_leaves_nothing(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with atomic_dir(target) as tmp:
            (tmp / "half.bin").write_text("x")
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []
    target.mkdir()
    (target / "old").write_text("old")
    with atomic_dir(target) as tmp:
        (tmp / "new").write_text("new")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and [p.name for p in target.iterdir()] == ["new"]


def test_missing_task_data_names_the_directory(tmp_path):
    from spap_lib.evaluation import zeroshot

    with pytest.raises(FileNotFoundError, match=f"{tmp_path}/piqa/validation.jsonl not found.*SPAP_DATA_DIR"):
        zeroshot.local_configs(["piqa"], tmp_path, root=tmp_path)
    with pytest.raises(ValueError, match="unknown task.*arc_easy"):
        zeroshot.local_configs(["hellaswag"], tmp_path, root=tmp_path)


def test_checkpoint_that_is_not_a_causal_lm_or_lacks_a_tokenizer(tmp_path, tiny_tokenizer):
    import json

    from spap_lib.model.loading import resolve

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertForMaskedLM"], "model_type": "bert"}))
    with pytest.raises(ValueError, match="BertForMaskedLM, not a causal language model"):
        resolve(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    with pytest.raises(FileNotFoundError, match="has no tokenizer"):
        resolve(str(tmp_path))
    tiny_tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="has a config.json but no weights"):  # never a random initialisation
        resolve(str(tmp_path))


def test_round_to_keeps_a_multiple(loaded):
    import spap_lib as sl

    plan = sl.plan_sparsity(loaded.adapter, 0.3, round_to=16)
    assert (plan.width - plan.n_remove) % 16 == 0
    for bad in (0.5, 0, -8, True):  # 0 used to be taken as "no rounding", silently
        with pytest.raises(ValueError, match=r"round_to .* must be an integer >= 1"):
            sl.plan_sparsity(loaded.adapter, 0.3, round_to=bad)


def test_underdetermined_fit_warns_only_for_methods_that_fit():
    """Fewer calibration tokens than MLP channels make a least-squares refit underdetermined:
    SPAP is warned about it, a score-only method (nothing is fitted) is not."""
    import warnings

    from conftest import tiny_model

    from spap_lib.model.adapters import get_adapter
    from spap_lib.model.loading import Loaded
    from spap_lib.model.sources import ModelSource

    calib = Calibration(torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0)),
                        torch.arange(2), "v", "s", 1, 0)  # 32 tokens < width 64

    def run(method):
        model = tiny_model("llama")
        loaded = Loaded(model, None, get_adapter(model), ModelSource("tiny", "dir", "-"), torch.device("cpu"))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sl.prune(loaded, calib, method, 0.2, hparams={"K": 2, "am_iters": 1, "adam_steps": 1}
                     if method == "spap" else None, progress=False)
        return [str(w.message) for w in caught if "underdetermined" in str(w.message)]

    assert run("spap") and "nsamples x seqlen >= 256" in run("spap")[0]
    assert run("magnitude") == [] and run("wanda_sp") == []
