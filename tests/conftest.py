"""Tiny random models of every supported architecture, built from configs (no downloads)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from filelock import FileLock

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
if "SPAP_DATA_DIR" not in os.environ and SHARED_DATA.is_dir():
    os.environ["SPAP_DATA_DIR"] = str(SHARED_DATA)
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _configs():
    from transformers import Gemma3TextConfig, LlamaConfig, OPTConfig, Qwen2Config

    common = dict(vocab_size=128, hidden_size=32, num_hidden_layers=3, num_attention_heads=4)
    return {
        "opt": OPTConfig(ffn_dim=64, word_embed_proj_dim=32, **common),
        "llama": LlamaConfig(intermediate_size=64, num_key_value_heads=2, **common),
        "qwen2": Qwen2Config(intermediate_size=64, num_key_value_heads=2, **common),
        # Gemma-3: GeGLU MLP, sliding/global layers with different masks and rotary embeddings
        "gemma3": Gemma3TextConfig(intermediate_size=64, num_key_value_heads=2, head_dim=8, sliding_window=8,
                                   layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                   **common),
    }


ARCHS = ["opt", "llama", "qwen2", "gemma3"]


def offline_model(alias: str):
    """An offline model alias resolved (``sl.resolve``), or the test skipped with the reason and the command that
    installs it: an optional model (the Qwen one, ``make setup-qwen``) is absent on a machine set up by ``make
    setup`` alone, as CI's is."""
    from spap_lib.errors import ModelNotInstalled
    from spap_lib.model.loading import resolve

    try:
        return resolve(alias)
    except ModelNotInstalled as err:
        pytest.skip(f"{alias} is not installed here: {err}")


def char_tokenizer():
    """A tokenizer that splits text into characters: WikiText-2's windows give varied activations (a word-level
    tokenizer of a few words maps it all to one unknown token, and the Gram matrices to rank one)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(33, 127)] + [" ", "\n"]
    tok = Tokenizer(models.WordLevel({"<unk>": 0, **{c: i + 1 for i, c in enumerate(chars)}}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def tiny_model(arch: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_configs()[arch]).eval()
    # Random init gives near-zero activations; widen weights so channels differ in importance.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(5)
    return model


def calibration(windows: torch.Tensor, tokens: int = 10_000):
    """A test's windows as a calibration set: consecutive offsets into a validation text of ``tokens`` tokens."""
    from spap_lib.evaluation.data import Calibration

    return Calibration(windows, torch.arange(len(windows)), "validation", "test-fixture", tokens, 0)


def prune_save_reload(loaded, method: str, hparams: dict, windows, tokenizer, tmp_path, *, tol: float = 1e-5):
    """Prune ``loaded`` at 30% on ``windows`` where it lives (CPU or GPU), then check what every method and
    composition promises: exactly the planned channels go, no layer is emptied, and the saved checkpoint reloads
    (stock transformers for uniform widths, spap's loader for per-layer ones) to the same logits."""
    import json

    from transformers import AutoModelForCausalLM

    import spap_lib as sl

    loaded.tokenizer, device = tokenizer, loaded.device
    plan = sl.plan_sparsity(loaded.adapter, 0.3)
    dense = [loaded.adapter.width(layer) for layer in loaded.adapter.layers()]
    calib = calibration(windows)
    report = sl.prune(loaded, calib, method, 0.3, hparams=hparams, progress=False)
    widths = [loaded.adapter.width(layer) for layer in loaded.adapter.layers()]
    assert sum(d - w for d, w in zip(dense, widths)) == plan.n_remove * len(widths)  # exactly the planned channels
    assert min(widths) >= 1
    out = sl.save(loaded, report, tmp_path / "m")
    if len(set(widths)) == 1:
        reloaded = AutoModelForCausalLM.from_pretrained(out).to(device).eval()  # stock transformers
    else:
        assert json.loads((out / "config.json").read_text())["spap_mlp_widths"] == widths
        reloaded = sl.load(str(out), device=str(device), dtype="float32").model
    with torch.no_grad():
        ids = windows.to(device)
        torch.testing.assert_close(reloaded(ids).logits, loaded.model(ids).logits, rtol=tol, atol=tol)
    return report


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(params=ARCHS)
def arch(request):
    return request.param


@pytest.fixture
def loaded(arch):
    from spap_lib.model.adapters import get_adapter
    from spap_lib.model.loading import Loaded
    from spap_lib.model.sources import ModelSource

    model = tiny_model(arch)
    return Loaded(model, None, get_adapter(model), ModelSource(f"tiny-{arch}", "dir", "-"), torch.device("cpu"))


@pytest.fixture
def windows():
    return torch.randint(0, 128, (4, 24), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="session")
def tiny_tokenizer():
    """A 128-token word-level tokenizer, enough for save/load and perplexity plumbing."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, 128)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


@pytest.fixture(autouse=True)
def _torch_threads():
    """Each test starts with torch's own thread count: a test that sets a job's or a profile's (one thread) would
    otherwise run every later test of the session on one core, slower and with other CPU sums."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _python_surface():
    """Each test starts with messages in Python's words (a notebook's parameter check switches them to
    papermill's for the rest of its kernel; in-process tests share one)."""
    from spap_lib.errors import surface

    with surface("python"):
        yield


@pytest.fixture(scope="session")
def byte_tokenizer():
    """A byte-level BPE tokenizer of 97 tokens that stock ``AutoTokenizer`` reloads as it was for every architecture:
    transformers 5 rebuilds a qwen2 checkpoint's tokenizer as ``Qwen2Tokenizer`` whatever class it was saved with, so
    a word-level one comes back splitting text otherwise (and ``sl.save`` refuses it)."""
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    chars = [chr(c) for c in range(33, 127)] + ["Ġ", "Ċ", "ĉ"]  # printable ASCII, then space, newline, tab
    return Qwen2Tokenizer(vocab={c: i for i, c in enumerate(chars)}, merges=[])


@pytest.fixture
def tiny_checkpoint(tmp_path, tiny_tokenizer):
    """``tiny_checkpoint(arch)``: a tiny random model of ``arch`` saved with the tiny tokenizer as a checkpoint
    folder (what a user passes as a local model); returns its path."""
    def save(arch: str = "llama"):
        path = tmp_path / f"tiny-{arch}"
        tiny_model(arch).save_pretrained(path)
        tiny_tokenizer.save_pretrained(path)
        return path
    return save


@pytest.fixture
def checkpoint(tiny_checkpoint):
    """A tiny Llama checkpoint folder with its tokenizer (a test may build another with ``tiny_checkpoint``)."""
    return tiny_checkpoint()


@pytest.fixture(scope="session")
def oldest() -> Path:
    """The oldest supported transformers (requirements-oldest.txt), installed once into build/compat/ (keyed by the
    pins) beside the pinned torch, without touching the project's venv: ``PYTHONPATH`` it to run there."""
    import hashlib
    import subprocess
    import sys

    pins = Path(__file__).resolve().parents[1] / "requirements-oldest.txt"
    key = hashlib.sha256(pins.read_bytes()).hexdigest()[:12]
    target = pins.parent / "build" / "compat" / f"oldest-{key}"
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{target}.lock"):  # another test worker may be installing it
        if not (target / "transformers" / "__init__.py").is_file():
            tmp = target.with_name(target.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)  # an install cut short
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp),
                            "-r", str(pins)], check=True, timeout=600)
            tmp.rename(target)
    return target


# -- a Hugging Face hub cache as huggingface_hub lays it out (tests/hubcache.py) ------------------------------------
DATA = Path(os.environ.get("SPAP_DATA_DIR", Path(__file__).resolve().parents[1] / "data"))  # offline_hub hides it
HALF = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@pytest.fixture(scope="session")
def hub_home(tmp_path_factory, byte_tokenizer) -> Path:
    """``HF_HOME`` with a hub cache of tiny models, one per architecture and half dtype (``tiny-org/<arch>-<dtype>``),
    ``Qwen/Qwen2.5-0.5B`` (a tiny qwen2 under the id the alias names) and WikiText-2, its test split cut to its
    first rows: a whole-split perplexity of the paper's settings is a byte-level model's million tokens otherwise."""
    from hubcache import add_model, add_wikitext

    home = tmp_path_factory.mktemp("hf-home")
    for arch in ARCHS:
        for name, dtype in HALF.items():
            add_model(home / "hub", f"tiny-org/{arch}-{name}", tiny_model(arch), byte_tokenizer, dtype)
    add_model(home / "hub", "Qwen/Qwen2.5-0.5B", tiny_model("qwen2"), byte_tokenizer, torch.bfloat16)
    add_wikitext(home / "hub", DATA, test_rows=2000)
    return home


def use_hub_home(home: Path, tmp_path: Path, monkeypatch) -> None:
    """``HF_HOME`` pointing at ``home``, ``HF_HUB_OFFLINE=1``, and a data directory that does not exist: every file
    comes from the cache (in this process and in the notebooks' kernels)."""
    import datasets
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))  # read when imported: this process's
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    monkeypatch.setenv("SPAP_DATA_DIR", str(tmp_path / "no-data-dir"))


@pytest.fixture
def offline_hub(hub_home, tmp_path, monkeypatch) -> Path:
    use_hub_home(hub_home, tmp_path, monkeypatch)
    return hub_home


@pytest.fixture(scope="session")
def short_text(tmp_path_factory) -> Path:
    """A data directory of WikiText-2's first lines: the prune matrix's runs each tokenize it three times, and it is
    the model files they test (the text read from the cache is tested on its own)."""
    from spap_lib.evaluation.data import SPLIT_FILES, WIKITEXT

    folder = tmp_path_factory.mktemp("short-text") / WIKITEXT
    folder.mkdir()
    for task in DATA.iterdir():  # the zero-shot tasks as they are
        if task.is_dir() and task.name != WIKITEXT:
            (folder.parent / task.name).symlink_to(task)
    for name in SPLIT_FILES.values():
        if (DATA / WIKITEXT / name).is_file():
            lines = (DATA / WIKITEXT / name).read_text(encoding="utf-8").splitlines(keepends=True)
            (folder / name).write_text("".join(lines[:600]), encoding="utf-8")
    return folder.parent
