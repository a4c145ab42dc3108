"""Sequential onloading: offload none, cpu and disk give the same prune, the same numbers and the same
checkpoint, with only one decoder layer's weights on the device (and, for disk, in memory) at a time."""
from __future__ import annotations

import json
import os
import weakref
from contextlib import contextmanager

import pytest
import torch
from transformers import AutoModelForCausalLM

import spap_lib as sl
from spap_lib.checks import ParameterError
from spap_lib.evaluation.data import Calibration
from spap_lib.evaluation.perplexity import perplexity_of_ids
from spap_lib.model.loading import load
from spap_lib.model.offload import SPILL_PREFIX, DiskOffload, HostOffload, SpilledActivations

MODES = ("none", "cpu", "disk")
TINY_SPAP = {"K": 3, "am_iters": 1, "adam_steps": 2}


@pytest.fixture
def checkpoint(tiny_checkpoint, arch):
    return tiny_checkpoint(arch)


def _calib(n=4, seqlen=24):
    windows = torch.randint(0, 128, (n, seqlen), generator=torch.Generator().manual_seed(1))
    return Calibration(windows, [0] * n, "validation", "test", 1000, 0)


@contextmanager
def _one_layer_at_a_time(loaded):
    """Spy on the onloader: layer contexts never overlap (cpu: one layer on the device), and (disk)
    while one is onloaded every other layer is on the meta device: in no memory at all."""
    onloader, seen, active = loaded.onloader, [], []
    real = type(onloader).layer

    @contextmanager
    def spy(self, i):
        active.append(i)
        with real(self, i) as layer:
            others = [j for j in active if j != i]
            if isinstance(self, DiskOffload):
                others += [j for j, other in enumerate(self.layers) if j != i
                           for p in other.parameters() if not p.is_meta]
            seen.append(sorted(set(others)))
            yield layer
        active.remove(i)

    onloader.layer = spy.__get__(onloader)
    try:
        yield seen
    finally:
        del onloader.layer


@pytest.mark.parametrize("method,hparams", [("spap", TINY_SPAP), ("flap", {})])
def test_offload_modes_give_the_same_prune_and_checkpoint(checkpoint, tmp_path, arch, method, hparams):
    """Same seed: identical kept channels, perplexity and reloaded logits in every mode; the disk mode's
    sharded checkpoint (and the others) load with stock transformers (uniform widths) or sl.load.
    FLAP: a global allocation (per-layer widths) and, where the architecture has the slot, a bias."""
    if method == "flap":
        hparams = {"bias": arch in ("llama", "opt")}
    ids = torch.randint(0, 128, (200,), generator=torch.Generator().manual_seed(2))
    sample = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(3))
    results = {}
    for mode in MODES:
        loaded = load(str(checkpoint), device="cpu", offload=mode, spill_dir=tmp_path / "spill")
        assert loaded.offload == mode
        untied = not loaded.model.config.tie_word_embeddings
        # disk: input embeddings that are not the head stay in the files, read a batch's rows at a time
        assert loaded.model.get_input_embeddings().weight.is_meta == (mode == "disk" and untied)
        dense = perplexity_of_ids(loaded.model, ids, 24, onloader=loaded.onloader, progress=False)
        report = sl.prune(loaded, _calib(), method, 0.2, hparams=hparams, progress=False)
        pruned = perplexity_of_ids(loaded.model, ids, 24, onloader=loaded.onloader, progress=False)
        out = tmp_path / f"out-{mode}"
        sl.save(loaded, report, out)
        checks = sl.artifact.manifest.read_checkpoint_manifest(out)["checks"]
        assert checks["reload_max_abs_diff"] <= 1e-4
        config = json.loads((out / "config.json").read_text())
        reloaded = sl.model.loading.load_nonuniform(out, torch.float32) if "spap_mlp_widths" in config else \
            AutoModelForCausalLM.from_pretrained(out)
        with torch.no_grad():
            logits = reloaded(input_ids=sample, use_cache=False).logits
        results[mode] = (report["kept_channels"], dense["ppl"], pruned["ppl"], logits, report["offload"])
    kept, dense, pruned, logits, _ = results["none"]
    for mode in MODES[1:]:
        assert results[mode][0] == kept, f"offload={mode} kept other channels"
        assert results[mode][1] == pytest.approx(dense, rel=1e-6)
        assert results[mode][2] == pytest.approx(pruned, rel=1e-6)
        assert float((results[mode][3] - logits).abs().max()) <= 1e-4
        assert results[mode][4] == mode
    if method == "spap":  # uniform widths: the disk mode wrote a sharded, stock-loadable checkpoint
        index = json.loads((tmp_path / "out-disk" / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) == 1 + untied + len(kept)  # the embeddings' own shard


@pytest.mark.parametrize("mode", ["cpu", "disk"])
def test_one_decoder_layer_at_a_time(checkpoint, tmp_path, mode, monkeypatch):
    # disk: the hidden states between layers are spill files, at most two alive (a layer's inputs and outputs)
    alive, most = [], [0]
    real_init = SpilledActivations.__init__

    def counting_init(self, *a, **k):
        real_init(self, *a, **k)
        alive.append(weakref.ref(self))
        most[0] = max(most[0], sum(r() is not None for r in alive))

    monkeypatch.setattr(SpilledActivations, "__init__", counting_init)
    loaded = load(str(checkpoint), device="cpu", offload=mode, spill_dir=tmp_path)
    assert isinstance(loaded.onloader, {"cpu": HostOffload, "disk": DiskOffload}[mode])
    if mode == "disk":  # nothing of the decoder layers is in memory before they are used
        assert all(p.is_meta for p in loaded.adapter.layers().parameters())
    with _one_layer_at_a_time(loaded) as seen:
        sl.prune(loaded, _calib(), "spap", 0.2, hparams=TINY_SPAP, progress=False)
    assert len(seen) == len(loaded.adapter.layers()) and all(others == [] for others in seen)
    if mode == "disk":
        assert all(p.is_meta for p in loaded.adapter.layers().parameters())
        spill = loaded.onloader.spill
        # the activation files are unlinked when created: only the pruned layers are visible
        assert sorted(f.name for f in spill.iterdir()) == [f"layer-{i:05d}.safetensors" for i in range(len(seen))]
        # layer-0 inputs; per layer the pruned outputs (propagating, the dense outputs are never computed)
        assert len(alive) == 1 + len(seen) and most[0] == 2
        loaded.onloader.close()
        assert not spill.exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_spilled_activations_read_back_what_was_written(tmp_path, dtype):
    x = torch.randn(5, 3, 4).to(dtype)
    spilled = SpilledActivations(tmp_path, x.shape, dtype)
    assert list(tmp_path.iterdir()) == []  # unlinked at once: nothing to clean up after a crash
    spilled[0:2], spilled[2:5] = x[0:2], x[2:5]
    assert torch.equal(spilled[0:5], x) and torch.equal(spilled[1:4], x[1:4]) and torch.equal(spilled[3:99], x[3:])
    assert spilled[4:4].shape == (0, 3, 4) and len(spilled) == 5
    with pytest.raises(ValueError, match=r"rows 0:2 of \(5, 3, 4\) cannot take a tensor of shape \(1, 3, 4\)"):
        spilled[0:2] = x[:1]
    with pytest.raises(TypeError, match="contiguous row ranges"):
        spilled[::2]


@pytest.mark.parametrize("run", ["load with disk offload", "check_run of any run"])
def test_a_killed_runs_spill_folder_is_removed(tmp_path, checkpoint, run):
    """A killed disk-offload prune leaves its spill folder; the next run of any kind removes it."""
    import spap_lib as sl
    from spap_lib.files import HOST

    dead = tmp_path / f"{SPILL_PREFIX}{HOST}-{2**22 + 12345}-abc"  # above Linux's largest pid: never alive
    dead.mkdir()
    (dead / "layer-00000.safetensors").write_bytes(b"x")
    mine = tmp_path / f"{SPILL_PREFIX}{HOST}-{os.getpid()}-abc"
    mine.mkdir()
    if run.startswith("load"):
        load(str(checkpoint), device="cpu", offload="disk", spill_dir=tmp_path)
    else:
        sl.check_run(str(checkpoint), method="magnitude", sparsity=0.2, spill_dir=tmp_path)
    assert not dead.exists() and mine.exists()  # a live process's spill is never touched


def test_pickle_checkpoints_cannot_stream(tmp_path, tiny_tokenizer, monkeypatch):
    from conftest import tiny_model

    path = tmp_path / "bin"
    tiny_model("llama").save_pretrained(path, safe_serialization=False)
    tiny_tokenizer.save_pretrained(path)
    if not list(path.glob("*.bin")):  # this transformers writes safetensors regardless: make a .bin by hand
        torch.save(tiny_model("llama").state_dict(), path / "pytorch_model.bin")
        for f in path.glob("*.safetensors"):
            f.unlink()
    monkeypatch.setattr(sl, "load", lambda *a, **k: pytest.fail("loaded weights"))
    with pytest.raises(ParameterError, match=r"pickle weights \(pytorch_model.bin\).*offload='cpu' or 'none'"):
        sl.check_run(str(path), method="spap", sparsity=0.2, nsamples=4, seqlen=16, offload="disk")


def test_unknown_offload_lists_the_valid_ones(checkpoint):
    for call in (lambda: sl.check_run(str(checkpoint), offload="gpu"), lambda: load(str(checkpoint), offload="ram")):
        with pytest.raises(ParameterError, match="unknown offload .*auto, none, cpu, disk"):
            call()
    with pytest.raises(ParameterError, match="'auto' is resolved by the plan"):
        load(str(checkpoint), offload="auto")


def test_auto_offload_is_the_fastest_that_fits(monkeypatch):
    from spap_lib.plan import plan

    roomy = plan("llama-3.1-8b", device="h100", offload="auto", host_memory_gb=512)
    assert roomy.offload == "none" and roomy.fits
    card = plan("llama-3.1-8b", device="rtx4090", offload="auto", host_memory_gb=64)
    assert card.offload == "cpu" and card.fits and card.peak_device_gb <= 20  # the paper's 24 GB card, with margin
    small_host = plan("llama-3.1-8b", device="rtx4090", offload="auto", host_memory_gb=12)
    assert small_host.offload == "disk" and small_host.fits and small_host.peak_host_gb <= 12
    no_disk = plan("llama-3.1-8b", device="rtx4090", offload="auto", host_memory_gb=12, disk_free_gb=1)
    assert no_disk.offload == "disk" and not no_disk.fits and "of 1.0 GB free" in no_disk.table()
    big = plan("llama-3.1-70b", device="h100", offload="auto", host_memory_gb=128)
    assert big.offload == "disk" and big.fits


def test_a_plan_that_does_not_fit_names_the_offload(checkpoint, monkeypatch):
    from spap_lib import validate as api

    monkeypatch.setattr(api, "local_device", lambda device: ("cpu-2core", 1e-6))
    with pytest.raises(ParameterError, match="does not fit with offload='none'.*Use offload='disk'"):
        sl.check_run(str(checkpoint), method="spap", sparsity=0.2, nsamples=4, seqlen=16, offload="none")
    with pytest.raises(ParameterError, match="does not fit with offload='disk'.*a spill_dir on a larger disk"):
        sl.check_run(str(checkpoint), method="spap", sparsity=0.2, nsamples=4, seqlen=16, offload="auto")


@pytest.mark.parametrize("mode", ["cpu", "disk"])
def test_streamed_perplexity_holds_one_span_of_logits(checkpoint, tmp_path, mode, monkeypatch):
    """Offloaded, the evaluation asks the model's head for one span of positions at a time (``logits_to_keep``),
    never a window's logits; the perplexity is the resident one's."""
    from spap_lib.evaluation import perplexity as evaluate

    monkeypatch.setattr(evaluate, "LOSS_CHUNK", 5)
    ids = torch.randint(0, 128, (100,), generator=torch.Generator().manual_seed(2))
    resident = load(str(checkpoint), device="cpu")
    expected = perplexity_of_ids(resident.model, ids, 24, progress=False)["ppl"]
    loaded = load(str(checkpoint), device="cpu", offload=mode, spill_dir=tmp_path)
    positions = []
    hook = loaded.model.get_output_embeddings().register_forward_hook(lambda m, a, out: positions.append(out.shape[1]))
    got = perplexity_of_ids(loaded.model, ids, 24, onloader=loaded.onloader, progress=False)["ppl"]
    hook.remove()
    assert got == pytest.approx(expected, rel=1e-6)
    assert positions == [5, 5, 5, 5, 3] * 4  # 4 windows of 24: spans of 5 positions over the 23 with a target


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "F16"])
def test_gguf_tensors_dequantize_by_row_blocks_to_the_whole_result(qtype):
    """The store dequantizes a large tensor a block of rows at a time into one array (one float32 copy, not
    two); the result is gguf's own dequantization of the whole tensor, bit for bit, at a ragged last block."""
    import numpy as np
    from gguf import GGMLQuantizationType, dequantize, quantize

    from spap_lib.model.stores import _dequantized

    kind = GGMLQuantizationType[qtype]
    raw = quantize(np.random.default_rng(0).standard_normal((1000, 512)).astype(np.float32), kind)
    whole = dequantize(raw, kind)
    blocks = _dequantized(raw, kind, rows_per_block=96)
    assert blocks.shape == whole.shape == (1000, 512) and np.array_equal(blocks, whole)


def test_the_process_peak_outlives_the_per_stage_resets():
    """A stage's ``measured`` resets the kernel's high-water mark; the whole run's peak (bench/offload.py's
    column) must still count what came before it, such as a model's load."""
    from spap_lib.numerics.memory import measured, peak_rss_mb, process_peak_rss_mb

    ballast = torch.ones(256 * 2**20, dtype=torch.uint8)  # 256 MB resident, then freed
    del ballast
    high = peak_rss_mb()
    with measured():
        pass
    assert peak_rss_mb() < high - 128 and process_peak_rss_mb() >= high
