"""A sequential prune interrupted after some layers resumes where it stopped, with the same result."""
import json

import pytest
import torch
from conftest import calibration

import spap_lib as sl
from spap_lib.checks import ParameterError
from spap_lib.methods.spap.algorithm import SPAP

HP = {"K": 3, "am_iters": 2, "adam_steps": 2, "batch_tokens": 32}




def test_an_interrupted_prune_resumes_at_the_next_layer_with_the_same_weights(windows, tmp_path, monkeypatch):
    from conftest import tiny_model

    from spap_lib.model.adapters import get_adapter
    from spap_lib.model.loading import Loaded
    from spap_lib.model.sources import ModelSource

    def loaded():
        m = tiny_model("llama")
        return Loaded(m, None, get_adapter(m), ModelSource("tiny-llama", "dir", "-"), torch.device("cpu"))

    reference = loaded()
    sl.prune(reference, calibration(windows), "spap", 0.3, hparams=HP, progress=False)

    calls = []
    real = SPAP.prune

    def dies_at_layer_2(self, problem):
        calls.append(problem.layer_index)
        if problem.layer_index == 2:
            raise KeyboardInterrupt  # the session ends
        return real(self, problem)

    run = loaded()
    monkeypatch.setattr(SPAP, "prune", dies_at_layer_2)
    with pytest.raises(KeyboardInterrupt):
        sl.prune(run, calibration(windows), "spap", 0.3, hparams=HP, progress=False, resume_dir=tmp_path / "r")
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["hidden_002.bin", "layer_000.safetensors",
                                                                 "layer_001.safetensors", "state.json"]
    monkeypatch.setattr(SPAP, "prune", lambda self, problem: calls.append(problem.layer_index) or real(self, problem))
    again = loaded()  # a new process: fresh dense weights
    report = sl.prune(again, calibration(windows), "spap", 0.3, hparams=HP, progress=False, resume_dir=tmp_path / "r")
    assert calls == [0, 1, 2, 2] and report["resumed_at_layer"] == 2
    assert report["kept_channels"] == sl.prune(loaded(), calibration(windows), "spap", 0.3, hparams=HP,
                                               progress=False)["kept_channels"]
    for a, b in zip(again.model.state_dict().values(), reference.model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert not (tmp_path / "r").exists()  # finished: the layers are in the model


def test_another_runs_folder_is_refused(windows, tmp_path, monkeypatch):
    from conftest import tiny_model

    from spap_lib.model.adapters import get_adapter
    from spap_lib.model.loading import Loaded
    from spap_lib.model.sources import ModelSource

    m = tiny_model("llama")
    run = Loaded(m, None, get_adapter(m), ModelSource("tiny-llama", "dir", "-"), torch.device("cpu"))
    real = SPAP.prune
    monkeypatch.setattr(SPAP, "prune", lambda self, problem: (_ for _ in ()).throw(KeyboardInterrupt)
                        if problem.layer_index == 1 else real(self, problem))
    with pytest.raises(KeyboardInterrupt):
        sl.prune(run, calibration(windows), "spap", 0.3, hparams=HP, progress=False, resume_dir=tmp_path / "r")
    m = tiny_model("llama")
    fresh = Loaded(m, None, get_adapter(m), ModelSource("tiny-llama", "dir", "-"), torch.device("cpu"))
    another = r"holds the layers of another run \(differs in n_remove \(n_remove: \d+ there, \d+ now\)\)"
    with pytest.raises(ParameterError, match=another):
        sl.prune(fresh, calibration(windows), "spap", 0.2, hparams=HP, progress=False, resume_dir=tmp_path / "r")


def test_layers_pruned_by_other_code_are_refused_as_such(tmp_path):
    """A folder from another version of spap (its code hash differs) is
    refused naming the code, not mixed in, and the message says the layers cannot be reused."""
    from spap_lib.pipeline.resume import check_folder

    folder = tmp_path / "r"
    folder.mkdir()
    (folder / "state.json").write_text(json.dumps({"fingerprint": {"code": "old", "n_remove": 3}, "next": 1,
                                                   "hidden": {}}))
    with pytest.raises(ParameterError, match=r"pruned by other code .*cannot be reused: delete the folder"):
        check_folder(folder, {"code": "new", "n_remove": 3})
    assert check_folder(folder, {"code": "old", "n_remove": 3}) == "resume"


def test_saved_activations_go_back_batch_by_batch_into_a_spill_file(tmp_path):
    """offload="disk" keeps hidden states in spill files: they are written and read a batch at a time."""
    from spap_lib.model.adapters import MLP
    from spap_lib.model.offload import SpilledActivations
    from spap_lib.pipeline.resume import LayerCheckpoint

    hidden = torch.randn(5, 7, 3).to(torch.bfloat16)
    mlp = MLP([torch.randn(4, 3)], [None], torch.randn(3, 4), torch.randn(3), torch.relu, glu=False)
    ck = LayerCheckpoint(tmp_path / "r", {"run": 1})
    ck.save(0, mlp, hidden, 2, [{"layer": 0}], [[0, 1, 2, 3]])
    state = ck.load()
    back = ck.hidden(state, lambda shape, dtype: SpilledActivations(tmp_path, shape, dtype), 2)
    assert torch.equal(back[0:5], hidden) and state["next"] == 1
    again = ck.layer(0, mlp)
    assert torch.equal(again.W_out, mlp.W_out) and torch.equal(again.b_out, mlp.b_out) and again.b_in == [None]


def test_a_kill_between_the_activations_and_the_commit_resumes_on_the_committed_ones(tmp_path, monkeypatch):
    """The next layer's inputs are written before state.json: a kill in between must leave the resume
    reading the inputs that match the committed layer, not the new ones."""
    import spap_lib.pipeline.resume as resume
    from spap_lib.model.adapters import MLP

    mlp = MLP([torch.randn(4, 3)], [None], torch.randn(3, 4), None, torch.relu, glu=False)
    ck = resume.LayerCheckpoint(tmp_path / "r", {"run": 1})
    h1, h2 = torch.randn(4, 5, 3), torch.randn(4, 5, 3)
    ck.save(0, mlp, h1, 2, [{"layer": 0}], [[0, 1, 2, 3]])
    monkeypatch.setattr(resume, "write_json_atomic", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        ck.save(1, mlp, h2, 2, [{"layer": 0}, {"layer": 1}], [[0, 1, 2, 3]] * 2)
    monkeypatch.undo()
    state = ck.load()
    assert state["next"] == 1
    assert torch.equal(ck.hidden(state, lambda shape, dtype: torch.empty(shape, dtype=dtype), 2), h1)


def test_a_users_folder_is_never_used_or_cleared(tmp_path, windows):
    from spap_lib.pipeline.resume import LayerCheckpoint

    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ParameterError, match="is not empty and holds no state.json"):
        LayerCheckpoint(tmp_path, {"run": 1})
    ours = LayerCheckpoint(tmp_path / "r", {"run": 1})
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "state.json").write_text("{}")
    (tmp_path / "r" / "keep.txt").write_text("someone else's")
    ours.clear()
    assert [p.name for p in (tmp_path / "r").iterdir()] == ["keep.txt"]


def test_a_presets_saved_layers_are_tied_to_the_code_of_its_parts():
    """A preset's algorithm lives in its parent class and in the parts it composes: an edit there must invalidate
    its saved layers too, not only an edit of the preset's own (near empty) module; an edit of a part it does not
    compose does not."""
    import spap_lib as sl
    from spap_lib.methods.parts import composition
    from spap_lib.methods.parts import selection as parts
    from spap_lib.methods.spap import algorithm as spap
    from spap_lib.methods.spap import alternating, penalty
    from spap_lib.pipeline.resume import code_modules

    for name in ("spap_no_update", "spap_gd", "spap"):
        modules = set(code_modules(sl.get_method(name)))
        assert {spap, composition, parts, penalty, alternating} <= modules, name
    fasp = set(code_modules(sl.get_method("fasp")))
    assert {composition, parts} <= fasp and not {spap, penalty, alternating} & fasp  # wanda's score, a refit
    assert alternating in code_modules(sl.get_method("spap", select="wanda"))  # the rounds it composes
    assert sl.get_method("flap").parts()["update"] == "bias" and code_modules(sl.get_method("flap"))  # its own part
    cfsp = set(code_modules(sl.get_method("cfsp")))
    assert not {spap, penalty, alternating, composition} & cfsp and parts in cfsp  # its scores
