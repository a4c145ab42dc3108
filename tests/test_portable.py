"""A checkpoint saved by spap loads to the same logits and tokens in the oldest supported transformers
(requirements-oldest.txt, installed once into build/compat/ beside the pinned torch) as in the pinned one.

Every architecture gets a RoPE base other than 10,000 (the 4.x default a missing ``rope_theta`` falls back to), and
Llama one with Llama-3 scaling, so a checkpoint that older versions misread fails here.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import _configs, calibration, char_tokenizer

import spap_lib as sl
from spap_lib.artifact.portable import legacy_rope
from spap_lib.errors import CheckpointError

REPO = Path(__file__).resolve().parents[1]
TEXT = "The 1990s game , Valkyria Chronicles III , was released in 2011 .\n = = Plot = = \n"
ROPE = {  # per architecture: rope_parameters the test gives it
    "llama": {"rope_type": "default", "rope_theta": 100000.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "qwen2": {"rope_type": "default", "rope_theta": 1000000.0},
    "gemma3": {"sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},
               "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}},
    "opt": None,  # learned positions
}

READ = """
import json, sys, torch, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
out = {"version": transformers.__version__}
for folder in sys.argv[2:]:
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok(sys.argv[1], return_tensors="pt").input_ids
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out[folder] = {"ids": ids[0].tolist(), "logits": model(ids).logits[0].tolist()}
print(json.dumps(out))
"""


def _saved(arch: str, tmp_path: Path) -> Path:
    """A tiny ``arch`` with its test RoPE, pruned by FASP and saved by spap."""
    from transformers import AutoModelForCausalLM

    config = _configs()["llama" if arch == "llama3" else arch]
    if ROPE[arch]:
        config.rope_parameters = ROPE[arch]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    dense = tmp_path / f"{arch}-dense"
    model.save_pretrained(dense)
    char_tokenizer().save_pretrained(dense)
    loaded = sl.load(str(dense), device="cpu")
    windows = torch.randint(1, 97, (4, 16), generator=torch.Generator().manual_seed(1))
    calib = calibration(windows, 64)
    report = sl.prune(loaded, calib, "fasp", 0.25, progress=False)
    return sl.save(loaded, report, tmp_path / arch)


def test_every_architecture_loads_the_same_in_the_oldest_supported_transformers(oldest, tmp_path):
    folders = [str(_saved(arch, tmp_path)) for arch in ROPE]
    env = {**os.environ, "PYTHONPATH": str(oldest), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-c", READ, TEXT, *folders], env=env, capture_output=True, text=True,
                         timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    old = json.loads(run.stdout.strip().splitlines()[-1])
    assert old["version"] == "4.56.2"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for arch, folder in zip(ROPE, folders):
        tok = AutoTokenizer.from_pretrained(folder)
        ids = tok(TEXT, return_tensors="pt").input_ids
        assert old[folder]["ids"] == ids[0].tolist(), arch
        with torch.no_grad():
            logits = AutoModelForCausalLM.from_pretrained(folder).eval()(ids).logits[0]
        diff = float((torch.tensor(old[folder]["logits"]) - logits).abs().max())
        assert diff <= 1e-4, f"{arch}: transformers 4.56.2 loads other logits (max |diff| {diff:.3g})"


def test_the_legacy_fields_say_what_rope_parameters_says():
    assert legacy_rope(ROPE["llama"]) == {"rope_theta": 100000.0}
    assert legacy_rope(ROPE["llama3"])["rope_scaling"]["rope_type"] == "llama3"
    assert legacy_rope(ROPE["gemma3"]) == {"rope_theta": 1000000.0, "rope_local_base_freq": 20000.0,
                                          "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    scaled_sliding = {**ROPE["gemma3"], "sliding_attention": {"rope_type": "linear", "factor": 2.0,
                                                               "rope_theta": 1e4}}
    with pytest.raises(CheckpointError, match="transformers 4.x runs them unscaled"):
        legacy_rope(scaled_sliding)
