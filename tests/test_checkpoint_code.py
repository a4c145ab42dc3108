"""spap never runs code that a checkpoint carries: a folder, a GGUF's folder or a hub snapshot whose configs name
classes of their own (``auto_map``) is refused in one line before anything is read, whether stdin answers yes,
answers nothing or is closed; a pickle that holds more than tensors is refused as such, and nothing in it runs."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import offline_model, tiny_model, use_hub_home
from hubcache import add_repo
from safetensors.torch import load_file
from test_entry_points import refused, spap

import spap_lib as sl
from spap_lib.errors import SourceError

SHORT = ("--nsamples", "4", "--seqlen", "24", "--eval-seqlen", "24", "--eval-windows", "2", "--device", "cpu")


def _carry_code(folder: Path, marker: Path, where: str) -> Path:
    """``folder`` with ``evil.py``, whose import leaves ``marker`` behind, named by ``where``'s ``auto_map``."""
    (folder / "evil.py").write_text(
        "from pathlib import Path\n"
        f"Path({str(marker)!r}).write_text('the checkpoint ran its code')\n"
        "from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast\n"
        "class EvilTok(PreTrainedTokenizerFast): pass\n"
        "class EvilConfig(LlamaConfig): pass\n"
        "class EvilModel(LlamaForCausalLM): pass\n")
    entry = {"tokenizer_config.json": {"AutoTokenizer": [None, "evil.EvilTok"]},
             "config.json": {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}}[where]
    path = folder / where
    raw = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**raw, "auto_map": entry}))
    return folder


def _process(*args, stdin: str | None) -> subprocess.CompletedProcess:
    """The real script, with ``stdin`` as its input (``None``: closed), as a user at a terminal would answer."""
    return subprocess.run([sys.executable, "-m", "spap_lib.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300, input=stdin, stdin=subprocess.DEVNULL if stdin is None else None)


@pytest.mark.parametrize("where", ["tokenizer_config.json", "config.json"])
def test_a_checkpoint_that_carries_code_is_refused_before_it_runs(tiny_checkpoint, tmp_path, where):
    """Every command, with yes on stdin (what would let transformers run the code); eval also with an empty and a
    closed stdin (where transformers would ask, or fail with a traceback)."""
    marker = tmp_path / "ran"
    folder = _carry_code(tiny_checkpoint(), marker, where)
    cases = [(("prune", folder, "--out", tmp_path / "o", *SHORT), "yes\n" * 20),
             (("plan", folder, "--nsamples", "4", "--seqlen", "24"), "yes\n" * 20),
             *[(("eval", folder, *SHORT[4:]), stdin) for stdin in ("yes\n" * 20, "", None)]]
    for command, stdin in cases:
        err = refused(_process(*command, stdin=stdin), "carries code of its own", "evil.", "auto_map")
        assert "[y/N]" not in err and not marker.exists(), (command, stdin)
    assert not (tmp_path / "o").exists()


def test_the_python_api_refuses_it_too(tiny_checkpoint, tmp_path):
    marker = tmp_path / "ran"
    folder = _carry_code(tiny_checkpoint(), marker, "tokenizer_config.json")
    for call in (lambda: sl.load(str(folder)), lambda: sl.resolve(str(folder)),
                 lambda: sl.check_run(str(folder), nsamples=4, seqlen=24)):
        with pytest.raises(SourceError, match="carries code of its own"):
            call()
    assert not marker.exists()


def test_a_gguf_whose_folder_carries_code_is_refused(tmp_path):
    gguf = offline_model("smollm2-135m")
    folder = tmp_path / "g"
    folder.mkdir()
    (folder / gguf.gguf_file).symlink_to(Path(gguf.path) / gguf.gguf_file)
    marker = tmp_path / "ran"
    _carry_code(folder, marker, "tokenizer_config.json")
    refused(spap("eval", folder / gguf.gguf_file, *SHORT[4:]), "carries code of its own")
    assert not marker.exists()


def test_a_hub_snapshot_that_carries_code_is_refused(tmp_path, tiny_tokenizer, monkeypatch):
    marker = tmp_path / "ran"
    folder = tmp_path / "repo"
    tiny_model("llama").save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    _carry_code(folder, marker, "config.json")
    home = tmp_path / "hf"
    add_repo(home / "hub", "evil-org/llama", {p.name: p for p in folder.iterdir()})
    use_hub_home(home, tmp_path, monkeypatch)
    refused(spap("eval", "evil-org/llama", *SHORT[4:]), "evil-org/llama carries code of its own")
    assert not marker.exists()


def test_a_pickle_that_holds_more_than_tensors_is_refused_as_such(tiny_checkpoint, tmp_path):
    folder = tiny_checkpoint()
    state = {k: v for f in folder.glob("*.safetensors") for k, v in load_file(f).items()}
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (Path(marker).write_text, ("the pickle ran its code",))

    torch.save({**state, "extra": Payload()}, folder / "pytorch_model.bin")
    for f in folder.glob("*.safetensors"):
        f.unlink()
    err = refused(spap("eval", folder, *SHORT[4:]), "pytorch_model.bin is a pickle that holds more than tensors",
                  "safetensors")
    assert "weights_only=False" not in err and not marker.exists()
