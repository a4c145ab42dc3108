"""The same invariants on CUDA (skipped where there is none: CI, this project's CPU machines).

Run on a GPU machine with ``pytest -m gpu``: every method prunes the tiny models on the device,
global allocation (which indexed CPU tensors with CUDA indices) works there, the float32
precision path keeps the float64 channels, and a bf16/fp16 hub checkpoint is saved in its own dtype.
"""
import pytest
import torch

import spap_lib as sl
from spap_lib.evaluation.data import Calibration
from spap_lib.model.loading import Loaded
from spap_lib.model.offload import Onloader
from spap_lib.model.sources import ModelSource

pytestmark = pytest.mark.gpu
FAST = {"K": 5, "am_iters": 2, "adam_steps": 2, "batch_tokens": 32}


def _on_cuda(arch):
    from conftest import tiny_model

    model = tiny_model(arch).to("cuda")
    return Loaded(model, None, sl.get_adapter(model), ModelSource("t", "dir", "-"), torch.device("cuda"))


@pytest.mark.parametrize("method", sorted(m for m in sl.METHODS if sl.METHODS[m].pipeline == "layers"))  # MLP channels
def test_every_method_prunes_on_cuda(method, arch, windows, tiny_tokenizer, tmp_path):
    loaded = _on_cuda(arch)
    loaded.tokenizer = tiny_tokenizer
    hp = FAST if method in ("spap", "spap_gd") else ({"K": 5} if method == "spap_no_update" else {})
    if method == "flap" and arch in ("qwen2", "gemma3"):
        hp = {"bias": False}
    calib = Calibration(windows, torch.arange(len(windows)), "v", "s", 1, 0)
    report = sl.prune(loaded, calib, method, 0.3, hparams=hp, progress=False)
    assert report["memory"]["cuda_peak_mb"] > 0
    sl.save(loaded, report, tmp_path / "m")  # finite logits and the reload check, on the device


def test_spap_global_allocation_and_float32_on_cuda(windows):
    calib = Calibration(windows, torch.arange(len(windows)), "v", "s", 1, 0)
    kept = {}
    for precision in ("float64", "float32"):
        loaded = _on_cuda("llama")
        report = sl.prune(loaded, calib, "spap", 0.3, hparams={**FAST, "allocation": "global", "precision": precision},
                          progress=False)
        kept[precision] = report["kept_channels"]
    assert kept["float32"] == kept["float64"]


@pytest.mark.parametrize("label", ["spap/select=act_norm,allocation=error", "spap/allocation=angular",
                                   "spap/allocation=error,allocation_precision=bf16,allocation_sample=0.5",
                                   "fasp/select=magnitude,allocation=global"])
def test_compositions_on_cuda(label, windows, tiny_tokenizer, tmp_path):
    """The parts compose on the device too: a non-uniform allocation's dense pass (bf16 products, a share of the
    windows) spends exactly the plan, never empties a layer, and its checkpoint reloads to the same logits."""
    from conftest import prune_save_reload

    from spap_lib.artifact.grid import Variant

    variant = Variant.parse(label)
    method = sl.get_method(variant.method, **variant.hparams)
    hp = {**{k: v for k, v in FAST.items() if k in method.effective_hparams()}, **variant.hparams}
    prune_save_reload(_on_cuda("llama"), variant.method, hp, windows, tiny_tokenizer, tmp_path, tol=1e-4)


@pytest.mark.parametrize("mode", ["cpu", "disk"])
def test_offload_on_cuda_matches_resident(arch, mode, tiny_tokenizer, tmp_path, monkeypatch):
    """Weights in host memory (or read from disk), one layer at a time on the GPU, the MLP inputs and targets
    streamed from pinned host memory: the same prune and the same perplexity as with everything
    resident on the GPU."""
    from conftest import tiny_model

    from spap_lib.evaluation.perplexity import perplexity_of_ids

    tiny_model(arch).save_pretrained(tmp_path / "m")
    tiny_tokenizer.save_pretrained(tmp_path / "m")
    windows = torch.randint(0, 128, (4, 24), generator=torch.Generator().manual_seed(1))
    calib = Calibration(windows, [0] * 4, "validation", "test", 1000, 0)
    ids = torch.randint(0, 128, (200,), generator=torch.Generator().manual_seed(2))
    runs, placed = {}, []
    real = Onloader.calibration

    def calibration(self, shape, dtype):  # where each layer's MLP inputs and targets waited
        t = real(self, shape, dtype)
        placed.append((self.mode, t.device.type, t.is_pinned()))
        return t

    monkeypatch.setattr(Onloader, "calibration", calibration)
    for offload in ("none", mode):
        loaded = sl.load(str(tmp_path / "m"), device="cuda", dtype="float32", offload=offload, spill_dir=tmp_path)
        report = sl.prune(loaded, calib, "spap", 0.2, hparams=FAST, progress=False)
        ppl = perplexity_of_ids(loaded.model, ids, 24, onloader=loaded.onloader, progress=False)["ppl"]
        runs[offload] = (report["kept_channels"], ppl)
        sl.save(loaded, report, tmp_path / f"out-{offload}")
    assert runs[mode][0] == runs["none"][0]
    assert runs[mode][1] == pytest.approx(runs["none"][1], rel=1e-4)
    # X and Y on the GPU when resident; offloaded, streamed from pinned host memory
    where = {"none": ("cuda", False), "cpu": ("cpu", True), "disk": ("cpu", True)}
    assert placed and all((device, pinned) == where[m] for m, device, pinned in placed), placed


def test_the_compiled_decode_gives_the_eager_tokens_on_cuda():
    """05's CUDA path (static cache, compiled step, CUDA graphs) is timed with events and decodes what eager does."""
    from spap_lib.evaluation import profile as prof

    model = _on_cuda("llama").model.eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(1)).cuda()
    auto = prof.time_generation(model, prompt, 16, repeats=2, warmup=1)
    eager = prof.time_generation(model, prompt, 16, repeats=1, warmup=0, decode="eager")
    assert auto["decode"] == "compiled" and auto["tokens"] == eager["tokens"]
    assert min(auto["decode_all"]) > 0 and auto["peak_mem_mb"] > 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_half_precision_hub_checkpoint_is_pruned_on_cuda_and_saved_in_its_dtype(offline_hub, short_text, monkeypatch,
                                                                                  tmp_path, dtype):
    """The hub cache of tests/test_hub_cache.py on the device: computed in bfloat16, saved in the source's dtype at
    every offload, the reload check within its tolerance at bf16 logits, and the three offloads' tensors equal."""
    import json

    from test_entry_points import spap
    from test_hub_cache import MODES, STORED, _tensors

    monkeypatch.setenv("SPAP_DATA_DIR", str(short_text))
    saved = {}
    for mode in MODES:
        out = tmp_path / mode
        result = spap("prune", f"tiny-org/llama-{dtype}", "--out", out, "--offload", mode, "--device", "cuda",
                      "--nsamples", "4", "--seqlen", "24", "--eval-seqlen", "24", "--eval-windows", "2",
                      "--hparams", '{"K": 3, "am_iters": 1, "adam_steps": 2}')
        assert result.returncode == 0, result.stderr[-2000:]
        checks = json.loads((out / "spap_manifest.json").read_text())["checks"]
        assert checks["saved_dtype"] == dtype and checks["reloaded_dtype"] == "bfloat16"
        assert checks["reload_max_abs_diff"] <= checks["reload_tolerance"]
        saved[mode] = _tensors(out)
        assert {str(t.dtype)[6:] for t in saved[mode].values()} == {dtype}, STORED[dtype]
    for mode in MODES[1:]:
        assert all(torch.equal(saved[mode][k], v) for k, v in saved["none"].items()), mode
