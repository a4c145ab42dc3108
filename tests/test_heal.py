"""Healing (``spap_lib.heal``): the divergence from the dense model falls, the healed checkpoint loads with stock
transformers, a resumed heal ends with an uninterrupted one's weights, and the evaluation's test split is never
read."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import DATA, calibration, tiny_model

import spap_lib as sl
from spap_lib.errors import ParameterError
from spap_lib.evaluation.data import SPLIT_FILES, WIKITEXT
from spap_lib.heal import distill as distill_module
from spap_lib.heal import heal, heal_text
from spap_lib.model.adapters import get_adapter
from spap_lib.model.loading import Loaded
from spap_lib.model.sources import ModelSource
from spap_lib.settings import HealConfig, RunConfig

VALID = DATA / WIKITEXT / SPLIT_FILES["validation"]


def _pair(tokenizer, arch: str = "llama") -> tuple[Loaded, Loaded, dict]:
    """A tiny model pruned by 30% (magnitude), the same dense model as its teacher, and the prune's report."""
    def made(name):
        m = tiny_model(arch)
        return Loaded(m, tokenizer, get_adapter(m), ModelSource(name, "dir", "-"), torch.device("cpu"))

    student, teacher = made(f"tiny-{arch}"), made(f"tiny-{arch}-dense")
    ids = tokenizer(VALID.read_text()[:4000], return_tensors="pt").input_ids[0]
    report = sl.prune(student, calibration(ids[:8 * 24].view(8, 24)), "magnitude", 0.3, progress=False)
    return student, teacher, report


@pytest.fixture
def text(tmp_path):
    """Heal text: 8 windows of 32 of WikiText-2 validation's characters (one a character: the byte tokenizer's)."""
    path = tmp_path / "heal.txt"
    path.write_text(VALID.read_text()[4000:4000 + 8 * 32])
    return path


def _divergence(student, teacher, ids) -> float:
    with torch.no_grad():
        return float(distill_module.kl_sum(student.model(ids).logits, teacher.model(ids).logits, 1.0)) / ids.numel()


@pytest.mark.parametrize("train", ["all", "mlp", "lora"])
def test_heal_lowers_the_divergence_and_saves_a_stock_checkpoint(train, text, byte_tokenizer, tmp_path):
    """The divergence falls on the windows healed on (float32, outside the heal's own loss); a random tiny model's
    other windows say nothing, since its outputs swing with any change of weights."""
    from transformers import AutoModelForCausalLM

    student, teacher, pruned = _pair(byte_tokenizer)
    seen = byte_tokenizer(text.read_text(), return_tensors="pt").input_ids.view(8, 32)
    before = _divergence(student, teacher, seen)
    frozen = {n: p.clone() for n, p in student.model.named_parameters() if "mlp" not in n}
    cfg = HealConfig(tokens=30 * 4 * 32, data=str(text), seqlen=32, batch=4, lr=3e-3, train=train)
    report = heal(student, teacher, cfg, progress=False)
    assert report["steps"] == 30 and report["loss"]["last"] < report["loss"]["first"]
    assert _divergence(student, teacher, seen) < 0.8 * before
    if train == "mlp":  # nothing outside the MLPs moved
        assert all(torch.equal(p, frozen[n]) for n, p in student.model.named_parameters() if n in frozen)
    assert not any(p.requires_grad for p in student.model.parameters())
    assert report["data"]["source"].startswith("file:heal.txt") and report["trainable_params"] > 0
    out = sl.save(student, {**pruned, "heal": report}, tmp_path / "healed")
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()  # stock transformers: LoRA merged, no adapter keys
    assert not any("lora" in n for n in reloaded.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(reloaded(seen).logits, student.model(seen).logits, rtol=1e-5, atol=1e-5)
    card = (out / "README.md").read_text()
    assert "distilled from `tiny-llama-dense`" in card and "heal.txt" in card


def test_a_resumed_heal_ends_with_the_uninterrupted_weights(text, byte_tokenizer, tmp_path, monkeypatch):
    cfg = HealConfig(tokens=6 * 2 * 32, data=str(text), seqlen=32, batch=2, lr=3e-3, warmup=0.2)
    whole, teacher, _ = _pair(byte_tokenizer)
    heal(whole, teacher, cfg, progress=False)

    monkeypatch.setattr(distill_module, "SAVE_SECONDS", 0.0)  # a resume point after every step
    calls, loss = [], distill_module._loss

    def stops_at_the_fourth(*args):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return loss(*args)

    monkeypatch.setattr(distill_module, "_loss", stops_at_the_fourth)
    resumed, teacher, _ = _pair(byte_tokenizer)
    with pytest.raises(KeyboardInterrupt):
        heal(resumed, teacher, cfg, resume_dir=tmp_path, progress=False)
    assert torch.load(tmp_path / "heal_state.pt", weights_only=True)["step"] == 3
    calls.clear()
    resumed, teacher, _ = _pair(byte_tokenizer)
    report = heal(resumed, teacher, cfg, resume_dir=tmp_path, progress=False)
    assert len(calls) == 3 and report["steps"] == 6 and len(report["loss"]["curve"]) == 6
    for (name, a), b in zip(whole.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(a, b), name

    other = HealConfig(**{**vars(cfg), "lr": 1e-3})  # a state written for another heal is refused, naming why
    resumed, teacher, _ = _pair(byte_tokenizer)
    with pytest.raises(ParameterError, match="continues another heal"):
        heal(resumed, teacher, other, resume_dir=tmp_path, progress=False)


def test_the_test_split_is_never_read_nor_healed_on(byte_tokenizer, tmp_path, monkeypatch):
    from spap_lib.evaluation import data

    read, raw = [], data.read_raw_digest  # every read of a WikiText-2 file or a named text goes through it
    monkeypatch.setattr(data, "read_raw_digest", lambda path: read.append(path.name) or raw(path))
    student, teacher, _ = _pair(byte_tokenizer)
    report = heal(student, teacher, HealConfig(tokens=64, seqlen=32, batch=2), progress=False)
    assert report["data"]["split"] == "validation" and read == [SPLIT_FILES["validation"]]  # no train split here
    copy = tmp_path / "my_text.txt"  # the test split under another name
    copy.write_bytes((DATA / WIKITEXT / SPLIT_FILES["test"]).read_bytes())
    for named in (copy, DATA / WIKITEXT / SPLIT_FILES["test"]):
        with pytest.raises(ParameterError, match="test split"):
            heal_text(str(named))
    with pytest.raises(ParameterError, match="not a file"):
        heal_text(str(tmp_path / "missing.txt"))


def test_heal_options_are_checked_before_any_work():
    with pytest.raises(ParameterError, match="heal options \\['lrr'\\] unknown"):
        HealConfig.of(RunConfig(heal_tokens=10, heal={"lrr": 1}))
    with pytest.raises(ParameterError, match="heal train"):
        HealConfig.of(RunConfig(heal_tokens=10, heal={"train": "embeddings"}))
    assert HealConfig(tokens=1).steps == 1 and HealConfig(tokens=4 * 512 + 1, batch=4).steps == 2
    assert HealConfig().steps == 0


def _words(tmp_path, n: int = 2000):
    """A text in the tiny checkpoint's word-level vocabulary (``w1`` … ``w127``)."""
    gen = torch.Generator().manual_seed(0)
    path = tmp_path / "words.txt"
    path.write_text(" ".join(f"w{int(i)}" for i in torch.randint(1, 128, (n,), generator=gen)))
    return path


def test_spap_prune_heals_and_spap_heal_heals_a_saved_checkpoint(checkpoint, tmp_path, capsys, monkeypatch):
    from transformers import AutoModelForCausalLM

    from spap_lib.cli import main

    text, out, healed = _words(tmp_path), tmp_path / "pruned", tmp_path / "healed"
    common = ["--eval-seqlen", "24", "--eval-windows", "3", "--device", "cpu", "--heal-data", str(text),
              "--heal", '{"seqlen": 24, "batch": 2, "lr": 0.003}']
    assert main(["prune", str(checkpoint), "--method", "magnitude", "--sparsity", "0.25", "--out", str(out),
                 "--nsamples", "4", "--seqlen", "24", "--heal-tokens", "192", *common]) == 0
    printed = capsys.readouterr().out
    result = json.loads(printed[printed.index("\n{\n") + 1:])
    assert result["heal"]["steps"] == 4 and result["heal"]["data"].startswith("file:words.txt")
    assert {"dense", "unhealed", "pruned"} <= set(result["perplexity"])
    manifest = json.loads((out / "spap_manifest.json").read_text())
    assert manifest["heal"]["tokens"] == 192 and manifest["heal"]["teacher"] == str(checkpoint)
    assert "| healing | distilled from" in (out / "README.md").read_text()

    assert main(["heal", str(out), "--teacher", str(checkpoint), "--out", str(healed), "--heal-tokens", "96",
                 *common]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"plan: heal {out} on cpu-2core")  # the plan first, before any weight is read
    result = json.loads(printed[printed.index("\n{\n") + 1:])
    assert result["heal"]["steps"] == 2 and result["method"] == "magnitude"
    assert result["perplexity"]["unhealed"]["ppl"] == manifest["perplexity"]["pruned"]["ppl"]
    record = json.loads((healed / "spap_manifest.json").read_text())
    assert record["healed_from"] == str(out) and record["sparsity"] == manifest["sparsity"]
    AutoModelForCausalLM.from_pretrained(healed)  # stock transformers
    assert main(["heal", str(checkpoint), "--teacher", str(checkpoint), "--out", str(tmp_path / "x")]) == 2
    assert "not a spap checkpoint" in capsys.readouterr().err
    monkeypatch.setattr(sl, "load", lambda *a, **k: pytest.fail("a model was read before the heal text was checked"))
    assert main(["prune", str(checkpoint), "--method", "magnitude", "--sparsity", "0.25", "--out", str(tmp_path / "y"),
                 "--heal-tokens", "96", "--heal-data", str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt is not a file" in capsys.readouterr().err and not (tmp_path / "y").exists()


def test_the_plan_prices_a_heal_and_refuses_it_offloaded(capsys):
    from spap_lib.cli import main
    from spap_lib.plan import plan

    heal = HealConfig(tokens=262144)
    p = plan("smollm2-135m", heal=heal, offload="none")
    assert p.seconds["healing"] > 0 and p.prune_seconds < p.total_seconds
    assert p.heal_gb["healing: gradients and AdamW state"] == pytest.approx(12 * 135e6 * 0.8 / 2**30, rel=0.25)
    assert sum(p.heal_gb.values()) <= p.peak_device_gb
    assert not plan("smollm2-135m", heal=heal, offload="disk").fits  # healing trains the whole model resident
    mlp = plan("smollm2-135m", heal=HealConfig(tokens=262144, train="mlp"), offload="none")
    assert mlp.heal_gb["healing: gradients and AdamW state"] < p.heal_gb["healing: gradients and AdamW state"]
    assert main(["plan", "smollm2-135m", "--heal-tokens", "262144"]) == 0
    assert "healing after the prune" in capsys.readouterr().out


@pytest.mark.parametrize("method", ["magnitude", "wanda_sp/allocation=global"])
def test_spap_heal_plans_from_the_checkpoint_and_refuses_what_does_not_fit(method, checkpoint, windows, tmp_path,
                                                                            capsys, monkeypatch):
    """``spap heal``'s plan prices the checkpoint's own widths (one per layer where the allocation made them
    differ): its pruned-model part is the checkpoint's parameters, exactly. A teacher of another shape and a heal
    larger than the device are refused before any weight is read."""
    from spap_lib import plan as planning
    from spap_lib.cli import main

    loaded = sl.load(str(checkpoint), device="cpu")
    sl.save(loaded, sl.prune(loaded, calibration(windows), method, 0.3, progress=False), tmp_path / "p")
    widths = [loaded.adapter.width(layer) for layer in loaded.adapter.layers()]
    assert (len(set(widths)) > 1) == (method != "magnitude")
    heal = HealConfig(tokens=4096, seqlen=16, train="mlp")
    p = planning.plan_heal(str(tmp_path / "p"), str(checkpoint), heal)
    params = sum(t.numel() for t in loaded.model.parameters())  # a tied head once
    assert p.memory_gb["healing: the pruned model"] * 2**30 == 4 * params
    mlps = sum(t.numel() for n, t in loaded.model.named_parameters() if ".mlp." in n)
    assert p.memory_gb["healing: gradients and AdamW state"] * 2**30 == 12 * mlps
    with pytest.raises(ParameterError, match="is not the model .* was pruned from"):
        planning.plan_heal(str(checkpoint), str(tmp_path / "p"), heal)  # dense and pruned swapped

    monkeypatch.setattr(planning, "local_device", lambda device: ("cpu-2core", p.peak_gb / 2))
    monkeypatch.setattr(sl, "load", lambda *a, **k: pytest.fail("a weight was read"))
    assert main(["heal", str(tmp_path / "p"), "--teacher", str(checkpoint), "--out", str(tmp_path / "h"),
                 "--heal-tokens", "4096", "--heal", '{"seqlen": 16, "train": "mlp"}', "--no-eval"]) == 2
    err = capsys.readouterr().err
    assert "healing: gradients and AdamW state" in err and "does not fit" in err and "lora" in err


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_the_kl_term_and_its_gradient_are_autograds(temperature):
    """``kl_sum`` writes its gradient out in the forward, a slice of rows at a time: the value and the gradient are
    those autograd takes through the log-softmaxes (more rows than a slice, so the slices are joined)."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    s = torch.randn(3, distill_module.CHUNK // 2 + 7, 50, requires_grad=True)
    t = torch.randn(3, distill_module.CHUNK // 2 + 7, 50)
    ref = F.kl_div(F.log_softmax(s / temperature, -1).flatten(0, 1), F.log_softmax(t / temperature, -1).flatten(0, 1),
                   log_target=True, reduction="sum") * temperature ** 2
    (expected,) = torch.autograd.grad(0.7 * ref, s)
    ours = distill_module.kl_sum(s, t, temperature)
    (got,) = torch.autograd.grad(0.7 * ours, s)
    assert float(ours.detach()) == pytest.approx(float(ref.detach()), rel=1e-6)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
