"""Nothing lost, nothing silently wrong: one test (or a few) per class of bad input and fault.

out_dir safety, check-before-save, wrong numbers refused, parameters never ignored, errors that name
the real cause, leftovers of killed runs, and a fuzz of parameter values. Tiny checkpoints throughout.
"""
import json
import math
import os
import random
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import calibration

import spap_lib as sl
from spap_lib import files as io
from spap_lib.checks import ParameterError
from spap_lib.errors import CheckpointError, OutputError
from spap_lib.model.loading import Loaded
from spap_lib.model.sources import ModelSource
from spap_lib.numerics.linalg import NumericalError

FAST = {"K": 3, "am_iters": 1, "adam_steps": 2, "batch_tokens": 32}




def _loaded(arch="llama", tokenizer=None, **config):
    from conftest import tiny_model

    model = tiny_model(arch)
    for k, v in config.items():
        setattr(model.config, k, v)
    return Loaded(model, tokenizer, sl.get_adapter(model), ModelSource(f"tiny-{arch}", "dir", "-"), torch.device("cpu"))


def _files(path: Path) -> dict | None:
    """Every file below ``path`` (relative name -> bytes): what must survive a refused write."""
    if not path.is_dir():
        return None
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.fixture
def checkpoint(tmp_path, tiny_tokenizer, windows):
    """A saved spap checkpoint of a tiny Llama (the 'source model' of the out_dir tests)."""
    loaded = _loaded(tokenizer=tiny_tokenizer)
    report = sl.prune(loaded, calibration(windows), "magnitude", 0.2, progress=False)
    return sl.save(loaded, report, tmp_path / "model")


# -- out_dir: new, empty or a previous spap checkpoint; never anything else ---------------------

def test_out_dir_foreign_source_or_run_folder_is_refused_before_any_work(checkpoint, tmp_path, monkeypatch):
    foreign = tmp_path / "data"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    monkeypatch.setattr(sl, "load", lambda *a, **k: pytest.fail("work started"))
    cases = {foreign: "not a spap checkpoint", checkpoint: "would replace the source model",
             tmp_path: "would replace the source model", tmp_path / "run": "would replace the run folder",
             foreign / "notes.txt": "not a directory"}
    for out, message in cases.items():
        before = _files(out)
        with pytest.raises(OutputError, match=message):
            sl.check_run(str(checkpoint), out_dir=out, run_dir=tmp_path / "run", overwrite=True)
        assert _files(out) == before
    assert (foreign / "notes.txt").read_text() == "mine"


def test_previous_checkpoint_needs_overwrite_and_only_holds_our_files(checkpoint, tmp_path, tiny_tokenizer, windows):
    out = tmp_path / "pruned"
    assert sl.check_run(str(checkpoint), out_dir=out).out_state == "new"
    out.mkdir()
    assert sl.check_run(str(checkpoint), out_dir=out).out_state == "empty"
    loaded = _loaded(tokenizer=tiny_tokenizer)
    report = sl.prune(loaded, calibration(windows), "magnitude", 0.3, progress=False)
    sl.save(loaded, report, out)
    first = _files(out)
    with pytest.raises(OutputError, match="previous spap checkpoint .*overwrite=True"):
        sl.save(loaded, report, out)
    assert sl.check_run(str(checkpoint), out_dir=out, overwrite=True).out_state == "checkpoint"
    sl.save(loaded, report, out, overwrite=True)
    assert _files(out).keys() == first.keys()
    (out / "my_notes.txt").write_text("keep me")
    with pytest.raises(OutputError, match="files spap did not write .*my_notes.txt"):
        sl.save(loaded, report, out, overwrite=True)
    assert (out / "my_notes.txt").read_text() == "keep me"


def test_unwritable_out_dir_is_refused_before_any_work(tmp_path):
    """A read-only parent fails at the check, not after the prune. As root (CI) permissions do not
    bind, so the check runs in a child process that drops to an unprivileged user."""
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="spap-ro-"))
    try:
        os.chmod(base, 0o755)
        ro = base / "ro"
        ro.mkdir()
        os.chmod(ro, 0o555)
        code = ("import os, sys, types\n"  # spap_lib.artifact.manifest alone, without torch (see _CHILD)
                "pkg = sys.modules['spap_lib'] = types.ModuleType('spap_lib')\n"
                f"pkg.__path__ = [{str(Path(io.__file__).parent)!r}]\n"
                "import spap_lib.artifact.manifest as io\n"
                "if os.getuid() == 0: os.setgid(65534); os.setuid(65534)\n"
                f"try: io.check_out_dir({str(ro / 'out')!r})\n"
                "except io.OutputError as e: print(e); sys.exit(3)\n")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              cwd=Path(__file__).parents[1])
        assert proc.returncode == 3, proc.stdout + proc.stderr
        assert f"cannot write in {ro}" in proc.stdout and "Permission denied" in proc.stdout
    finally:
        os.chmod(base / "ro", 0o755)
        import shutil

        shutil.rmtree(base)


def test_outputs_get_the_users_normal_permissions(tmp_path, tiny_tokenizer, windows):
    loaded = _loaded(tokenizer=tiny_tokenizer)
    report = sl.prune(loaded, calibration(windows), "magnitude", 0.2, progress=False)
    old = os.umask(0o027)
    try:
        out = sl.save(loaded, report, tmp_path / "ckpt")
        io.write_json_atomic(tmp_path / "r.json", {"a": 1})
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o750
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {0o640}  # safetensors included
    assert stat.S_IMODE((tmp_path / "r.json").stat().st_mode) == 0o640


# -- check before save ----------------------------------------------------------------------------

def test_a_nan_model_never_replaces_a_good_checkpoint(tmp_path, tiny_tokenizer, windows):
    loaded = _loaded(tokenizer=tiny_tokenizer)
    report = sl.prune(loaded, calibration(windows), "magnitude", 0.2, progress=False)
    out = sl.save(loaded, report, tmp_path / "ckpt")
    good = _files(out)
    with torch.no_grad():
        loaded.model.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    with pytest.raises(CheckpointError, match=r"logits are not finite .*layers\.1\.mlp\.down_proj\.weight: 1 NaN"):
        sl.save(loaded, report, out, overwrite=True)
    assert _files(out) == good and not io.leftovers(out)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".") and not p.name.endswith(".lock")]  # kept


def test_a_checkpoint_that_reloads_differently_is_not_installed(tmp_path, tiny_tokenizer, windows, monkeypatch):
    loaded = _loaded(tokenizer=tiny_tokenizer)
    report = sl.prune(loaded, calibration(windows), "magnitude", 0.2, progress=False)
    real = loaded.model.save_pretrained

    def corrupting(path, **kw):  # writes a weight that differs from the in-memory model
        w = loaded.model.model.layers[0].mlp.up_proj.weight
        with torch.no_grad():
            w.add_(1.0)
            real(path, **kw)
            w.sub_(1.0)

    monkeypatch.setattr(loaded.model, "save_pretrained", corrupting)
    with pytest.raises(CheckpointError, match="does not reload to the same model"):
        sl.save(loaded, report, tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []


# -- wrong numbers are refused, not reported ------------------------------------------------------

def test_evaluation_windows_and_lengths(tiny_tokenizer):
    loaded = _loaded(tokenizer=tiny_tokenizer, max_position_embeddings=64)
    ids = torch.randint(0, 128, (400,), generator=torch.Generator().manual_seed(0))
    for bad in (-1, 0, 2.0, True, "4"):
        with pytest.raises(ParameterError, match="eval_windows must be an integer >= 1 or None"):
            sl.perplexity_of_ids(loaded.model, ids, 32, bad, progress=False)
    with pytest.raises(ParameterError, match="eval_seqlen=100 is longer than the model's context of 64"):
        sl.perplexity_of_ids(loaded.model, ids, 100, None, progress=False)
    ppl = sl.perplexity_of_ids(loaded.model, ids, 32, 3, progress=False)
    assert ppl["windows"] == 3 and math.isfinite(ppl["ppl"]) and ppl["ppl"] > 1


def test_calibration_beyond_the_context_is_refused_before_work(monkeypatch):
    from spap_lib.pipeline import sequential as pipeline

    for arch in ("llama", "opt"):  # OPT used to crash with an IndexError after the dense evaluation
        loaded = _loaded(arch, max_position_embeddings=16)
        windows = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
        monkeypatch.setattr(pipeline, "first_layer_inputs", lambda *a, **k: pytest.fail("work started"))
        with pytest.raises(ParameterError, match="seqlen=24 is longer than the model's context of 16"):
            sl.prune(loaded, calibration(windows), "magnitude", 0.2, progress=False)


@pytest.mark.parametrize("method, hparams, message", [
    ("spap", {"am_iters": -1}, "am_iters must be an integer >= 0"),
    ("spap", {"K": -3}, "K must be an integer >= 1"),
    ("spap", {"batch_tokens": 0}, "batch_tokens must be an integer >= 1"),
    ("spap", {"alpha": 5}, "alpha must be a number >= 0 and < 1"),
    ("spap", {"lr": float("nan")}, "lr must be a number > 0.*not finite"),
    ("spap", {"K": 2.5}, "K must be an integer"),
    ("spap", {"K": True}, "K must be an integer"),
    ("flap", {"bias": "false"}, "bias must be a boolean .*write True or False, unquoted"),
    ("flap", {"bias": 0}, "bias must be a boolean"),
    ("cfsp", {"scale": 0}, "scale must be a number > 0"),
    ("fasp", {"damp": -1e-3}, "damp must be a number >= 0"),
])
def test_hyperparameters_are_checked_on_their_declared_types_and_ranges(method, hparams, message):
    with pytest.raises(ParameterError, match=message):
        sl.get_method(method, **hparams)


# -- parameters are never silently ignored --------------------------------------------------------

def test_notebook_parameters_refuse_unknown_names_and_wrong_types():
    from typing import Optional

    def namespace(**injected):
        ns = {"__annotations__": {"sparsity": float, "eval_windows": Optional[int], "overwrite": bool,
                                  "hparams": dict},
              "sparsity": 0.2, "eval_windows": 4, "overwrite": False, "hparams": {}, "In": [], "Out": {},
              "Optional": Optional, "get_ipython": print}
        return {**ns, **injected}

    sl.check_notebook_parameters(namespace(), "02_prune")
    sl.check_notebook_parameters(namespace(eval_windows=None, sparsity=1), "02_prune")
    typo = r"does not take the parameter\(s\) 'sparsty' \(did you mean 'sparsity'\?\)"
    with pytest.raises(ParameterError, match=typo):
        sl.check_notebook_parameters(namespace(sparsty=0.5), "02_prune")
    for name, value, message in (("overwrite", "False", "overwrite must be a boolean"),
                                 ("eval_windows", 4.0, "eval_windows must be an integer"),
                                 ("sparsity", "0.2", "sparsity must be a number"),
                                 ("hparams", "{}", "hparams must be a mapping")):
        with pytest.raises(ParameterError, match=message):
            sl.check_notebook_parameters(namespace(**{name: value}), "02_prune")


@pytest.mark.parametrize("notebook", sorted(p.name for p in (Path(__file__).parents[1] / "notebooks").glob("*.ipynb")))
def test_every_parameter_line_parses_in_papermill(notebook, caplog):
    """papermill must see every annotated parameter (it skipped `X | None` lines and comments with '=')."""
    import ast

    import papermill

    path = Path(__file__).parents[1] / "notebooks" / notebook
    nb = json.loads(path.read_text())
    cell = next(c for c in nb["cells"] if "parameters" in c["metadata"].get("tags", []))
    annotated = {n.target.id for n in ast.parse("".join(cell["source"])).body if isinstance(n, ast.AnnAssign)}
    with caplog.at_level("WARNING", logger="papermill"):
        parsed = papermill.inspect_notebook(str(path))
    assert set(parsed) == annotated and annotated
    assert not [r for r in caplog.records if "Unable to parse" in r.getMessage()]


def test_chain_configs_only_name_declared_parameters(tmp_path):
    from spap_lib import nbparams

    bad = tmp_path / "c.yaml"
    bad.write_text("model: smollm2-135m\nsparsty: 0.5\n")
    with pytest.raises(ParameterError, match="sparsty is not a parameter of any notebook"):
        nbparams.for_notebook(bad, nbparams.NOTEBOOKS / "02_prune.ipynb")
    smoke = nbparams.for_notebook(Path(__file__).parents[1] / "configs" / "smoke.yaml",
                                  nbparams.NOTEBOOKS / "01_calibrate.ipynb")
    assert "hparams" not in smoke and smoke["model"] == "smollm2-135m"


# -- errors that name the real cause --------------------------------------------------------------

def test_nan_weights_are_named_before_any_work(monkeypatch, windows):
    from spap_lib.pipeline import sequential as pipeline

    loaded = _loaded()
    with torch.no_grad():
        loaded.model.model.layers[2].mlp.up_proj.weight[3, 1] = float("inf")
    monkeypatch.setattr(pipeline, "first_layer_inputs", lambda *a, **k: pytest.fail("work started"))
    with pytest.raises(NumericalError, match=r"model\.layers\.2\.mlp\.up_proj\.weight: 0 NaN, 1 Inf"):
        sl.prune(loaded, calibration(windows), "spap", 0.2, hparams=FAST, progress=False)


def test_nonfinite_activations_name_the_layer(windows):
    loaded = _loaded()
    with torch.no_grad():  # huge, finite weights: the activations of layer 1 overflow float32
        loaded.model.model.layers[1].post_attention_layernorm.weight.fill_(3e38)
    with pytest.raises(NumericalError, match="layer 1: the MLP inputs contain .* NaN and .* Inf"):
        sl.prune(loaded, calibration(windows), "spap", 0.2, hparams=FAST, progress=False)


@pytest.mark.parametrize("method", ["spap", "fasp", "spap_gd", "spap_no_update", "wanda_sp"])
def test_an_all_zero_mlp_keeps_its_dense_weights(method, windows, tiny_tokenizer, tmp_path):
    loaded = _loaded(tokenizer=tiny_tokenizer)
    with torch.no_grad():
        loaded.model.model.layers[1].mlp.up_proj.weight.zero_()  # every channel outputs zero
    hp = {"K": FAST["K"]} if method == "spap_no_update" else (FAST if method.startswith("spap") else {})
    report = sl.prune(loaded, calibration(windows), method, 0.3, hparams=hp, progress=False)
    if method != "wanda_sp":  # score methods fit nothing; the fitting ones must not divide by zero
        assert report["layers"][1].get("nothing_to_fit") is True
        assert "nothing_to_fit" not in report["layers"][0]
    sl.save(loaded, report, tmp_path / "ckpt")  # finite logits, reload checked


def test_corrupt_gguf_is_named_as_corrupt(tmp_path):
    import gguf

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(64, 16).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 1000])
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file " * 64)
    for name in ("cut.gguf", "junk.gguf"):
        with pytest.raises(ValueError, match=f"corrupt or truncated GGUF file {tmp_path / name}"):
            sl.check_run(str(tmp_path / name))
        with pytest.raises(ValueError, match="corrupt or truncated GGUF file"):
            sl.load(str(tmp_path / name))


def test_local_looking_paths_are_not_tried_on_the_hub(tmp_path, monkeypatch):
    import huggingface_hub

    for name in ("snapshot_download", "hf_hub_download"):  # a look-up of the local cache is not a hub request
        monkeypatch.setattr(huggingface_hub, name, lambda *a, **k: pytest.fail("tried the hub"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    for name in ("runs/pruned", "./pruned", str(tmp_path / "a" / "b"), "~/no-such-model", "x/y/z", "m.gguf"):
        with pytest.raises(FileNotFoundError, match="does not exist .* not tried on the Hugging Face hub"):
            sl.resolve(name)
    assert sl.resolve("Qwen/Qwen2.5-0.5B").kind == "hub"  # an org/name with no such local folder


def test_gpt2_is_named_as_an_unsupported_architecture(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)).save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="'gpt2' model .*unsupported architecture; spap supports .*llama"):
        sl.resolve(str(tmp_path))


# -- leftovers and kills ----------------------------------------------------------------------------

_CHILD = r"""
import importlib.util, os, shutil, signal, sys, types
# spap_lib.files and the errors it imports, without the package's __init__ (torch): a fast child
pkg = sys.modules["spap_lib"] = types.ModuleType("spap_lib")
pkg.__path__ = [os.path.dirname(sys.argv[1])]
spec = importlib.util.spec_from_file_location("spap_lib.files", sys.argv[1])
io = importlib.util.module_from_spec(spec); spec.loader.exec_module(io)
target, kill_at, exchange = sys.argv[2], int(sys.argv[3]), sys.argv[4] == "exchange"
calls = [0]

def step(fn):
    def wrapped(*a, **k):
        calls[0] += 1
        if calls[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return fn(*a, **k)
    return wrapped

for name in ("mkdir", "rename", "replace", "chmod", "remove", "unlink", "rmdir"):
    setattr(os, name, step(getattr(os, name)))
shutil.rmtree = step(shutil.rmtree)
io._exchange = step(io._exchange) if exchange else step(lambda a, b: False)
write = step(lambda p, text: p.write_text(text))
with io.atomic_dir(target) as tmp:
    for name in ("model.safetensors", "config.json", "spap_manifest.json"):
        write(tmp / name, "new " + name)
print("completed after", calls[0], "steps")
"""


@pytest.mark.parametrize("mode", ["exchange", "two-renames"])
def test_a_kill_at_any_step_of_a_save_loses_nothing(tmp_path, mode):
    """SIGKILL before each file-system step of a replacement: with the atomic exchange the old or the
    new checkpoint is at out_dir at every instant; with two renames (no exchange on this system) the
    next run restores it. Either way the next run leaves no scratch entry behind."""
    out = tmp_path / "ckpt"
    old = {n: f"old {n}" for n in ("model.safetensors", "config.json", "spap_manifest.json", "tokenizer.json")}
    new = {n: f"new {n}" for n in ("model.safetensors", "config.json", "spap_manifest.json")}
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    for kill_at in range(1, 100):
        if out.exists():
            import shutil

            shutil.rmtree(out)
        out.mkdir()
        for n, text in old.items():
            (out / n).write_text(text)
        proc = subprocess.run([sys.executable, str(script), io.__file__, str(out), str(kill_at), mode],
                              capture_output=True, text=True)
        state = {p.name: p.read_text() for p in out.iterdir()} if out.is_dir() else None
        if proc.returncode == 0:
            assert state == new and not io.leftovers(out) and kill_at > 5
            break
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        if mode == "exchange":
            assert state in (old, new), f"killed at step {kill_at}: {state}"
        io.clean_leftovers(out)  # what the next run does first
        state = {p.name: p.read_text() for p in out.iterdir()}
        assert state in (old, new), f"killed at step {kill_at}: {state}"
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".") and not p.name.endswith(".lock")] == []
    else:
        pytest.fail("the save never completed")


def test_leftovers_of_live_runs_are_left_alone(tmp_path):
    out = tmp_path / "ckpt"
    mine = out.with_name(f".ckpt.spap-tmp-{io.HOST}-{os.getpid()}-abc123")  # this process: alive
    dead = out.with_name(f".ckpt.spap-old-{io.HOST}-999999999-abc123")
    other = out.with_name(".ckpt.spap-tmp-otherhost-1-abc123")  # another machine's, on a shared disk
    for p in (mine, dead, other):
        p.mkdir()
    assert io.leftovers(out) == [dead]
    io.clean_leftovers(out)  # out was missing and `dead` held the previous version: put back
    assert out.is_dir() and mine.is_dir() and other.is_dir() and not dead.exists()


# -- fuzz: every value is either accepted and used, or refused with a message ---------------------

POOL = [None, True, False, 0, 1, -1, 2, 3, 7, 16, 10**9, 0.0, 0.2, 0.5, 0.999, 1.0, 1.5, -0.5, 1e-3,
        float("nan"), float("inf"), "0.2", "false", "", [], {}, [1], {"a": 1}]


def test_fuzz_method_hyperparameters_are_used_or_refused():
    import dataclasses

    rng = random.Random(0)
    accepted = refused = 0
    tunable = sorted(m for m in sl.METHODS if dataclasses.fields(sl.METHODS[m]))
    for _ in range(1500):
        name = rng.choice(tunable)
        fields = [f.name for f in dataclasses.fields(sl.METHODS[name])]
        hp = {k: rng.choice(POOL) for k in rng.sample(fields, rng.randint(1, min(3, len(fields))))}
        try:
            method = sl.get_method(name, **hp)
        except ParameterError as err:
            refused += 1
            assert any(k in str(err) for k in hp), (name, hp, str(err))
            continue
        accepted += 1
        used = method.hparams()
        assert all(used[k] == v and type(used[k]) is type(v) for k, v in hp.items()), (name, hp, used)
    assert accepted > 100 and refused > 100


def test_fuzz_run_parameters_are_used_or_refused(checkpoint, tiny_tokenizer):
    """check_run accepts a value only if the run then uses it without a later refusal."""
    rng = random.Random(1)
    text = sl.evaluation.data.Text(" ".join(f"w{i % 100 + 1}" for i in range(4000)), "validation", "fixture")
    ids = torch.randint(0, 128, (600,), generator=torch.Generator().manual_seed(0))
    loaded = sl.load(str(checkpoint), device="cpu")
    context = loaded.model.config.max_position_embeddings
    names = ["nsamples", "seqlen", "eval_seqlen", "eval_windows", "sparsity", "round_to", "seed"]
    for _ in range(150):
        params = {k: rng.choice(POOL) for k in rng.sample(names, rng.randint(1, 4))}
        try:
            sl.check_run(str(checkpoint), **params)
        except ParameterError as err:
            assert any(k in str(err) for k in params), (params, str(err))
            continue
        if {"nsamples", "seqlen"} & set(params) and params.get("seqlen", 8) < 64 and params.get("nsamples", 2) < 64:
            calib = sl.calibration_windows(tiny_tokenizer, params.get("nsamples") or 2, params.get("seqlen") or 8,
                                           params.get("seed", 0), text=text)
            assert calib.windows.shape == (params.get("nsamples") or 2, params.get("seqlen") or 8)
        if "sparsity" in params and params["sparsity"] is not None:
            plan = sl.plan_sparsity(loaded.adapter, params["sparsity"], params.get("round_to"))
            assert plan.sparsity == params["sparsity"]
        seqlen = params.get("eval_seqlen") or 16
        if seqlen <= min(context, 600):
            ppl = sl.perplexity_of_ids(loaded.model, ids, seqlen, params.get("eval_windows"), progress=False)
            windows = params.get("eval_windows")
            assert ppl["windows"] == min(600 // seqlen, windows or 10**9)


def _add_rows(path: str, who: str, n: int) -> None:
    from spap_lib.artifact.table import add_rows

    for i in range(n):
        add_rows(path, [{"who": who, "i": i}], ["who", "i"])


def test_two_processes_adding_rows_to_one_table_keep_each_others_rows(tmp_path):
    """Two grids (or a grid and 04) writing results/ablation.csv at once: every row of both survives."""
    import multiprocessing

    import pandas as pd

    path = str(tmp_path / "table.csv")
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_add_rows, args=(path, who, 15)) for who in ("a", "b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    table = pd.read_csv(path)
    assert len(table) == 30 and sorted(table.groupby("who")["i"].count()) == [15, 15]
