"""SliceGPT's rotation and slicing on tiny random OPT / Llama / Qwen2 models."""
import pytest
import torch
from conftest import tiny_model

from spap_lib.checks import ParameterError
from spap_lib.methods.slicegpt.slicing import SlicedBlock, fuse_norms, rotate_and_slice, sliced_dim

ARCHS = ["opt", "llama", "qwen2"]


def _model(arch, tied=False):
    model = tiny_model(arch)
    with torch.no_grad():  # norms with non-trivial scales and (OPT) biases, so fusion has work to do
        g = torch.Generator().manual_seed(1)
        for name, m in model.named_modules():
            if "norm" in type(m).__name__.lower() and getattr(m, "weight", None) is not None:
                m.weight.copy_(1 + 0.5 * torch.randn(m.weight.shape, generator=g))
                if getattr(m, "bias", None) is not None:
                    m.bias.copy_(0.3 * torch.randn(m.bias.shape, generator=g))
    if tied:
        model.lm_head.weight = model.get_input_embeddings().weight
    return model.double()  # float64 (HF's RMSNorm still normalises in float32: ~1e-7 of noise)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tied", [False, True])
def test_fusing_the_norms_keeps_the_logits(arch, tied, windows):
    model = _model(arch, tied)
    before = _logits(model, windows[:2])
    fuse_norms(model)
    assert all(isinstance(b, SlicedBlock) for b in model.model.layers) if arch != "opt" else True
    torch.testing.assert_close(_logits(model, windows[:2]), before, rtol=1e-5, atol=1e-6 * before.abs().max())
    assert model.lm_head.weight is not model.get_input_embeddings().weight


@pytest.mark.parametrize("arch", ARCHS)
def test_rotation_without_slicing_keeps_the_logits(arch, windows):
    model = _model(arch)
    before = _logits(model, windows[:2])
    layout = fuse_norms(model)
    dims = rotate_and_slice(model, layout, windows, model.config.hidden_size)
    assert {d["in"] for d in dims} == {model.config.hidden_size}
    torch.testing.assert_close(_logits(model, windows[:2]), before, rtol=1e-4, atol=1e-4 * before.abs().max())
    # and in the model's float32, to 1e-4
    model32 = _model(arch).float()
    before32 = _logits(model32, windows[:2])
    rotate_and_slice(model32, fuse_norms(model32), windows.clone(), sliced_dim(32, 0.0, 8))
    err = (_logits(model32, windows[:2]) - before32).abs().max() / before32.abs().max()
    assert err < 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_slicing_counts_exactly_and_degrades_gracefully(arch, windows):
    model = _model(arch)
    before = _logits(model, windows[:2])
    layout = fuse_norms(model)
    d, k = model.config.hidden_size, sliced_dim(32, 0.25, 8)
    assert k == 24
    dense_params = {n: p.numel() for n, p in model.named_parameters()}
    rotate_and_slice(model, layout, windows, k)
    after = _logits(model, windows[:2])
    assert torch.isfinite(after).all() and not torch.allclose(after, before)
    layers = model.model.decoder.layers if arch == "opt" else model.model.layers
    for i, blk in enumerate(layers):
        k_out = k if i < len(layers) - 1 else d
        assert tuple(blk.attn_shortcut.shape) == (k, k) and tuple(blk.mlp_shortcut.shape) == (k, k_out)
        for name, p in blk.block.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "fc1.weight", "gate_proj.weight",
                              "up_proj.weight")):
                assert p.shape[1] == k, name
            if name.endswith(("o_proj.weight", "out_proj.weight")):
                assert p.shape[0] == k, name
            if name.endswith(("fc2.weight", "down_proj.weight")):
                assert p.shape[0] == k_out, name
    emb = model.get_input_embeddings().weight
    assert emb.shape == (model.config.vocab_size, k) and model.lm_head.weight.shape == (model.config.vocab_size, d)
    # every parameter is where the shapes say: nothing kept at the old width by accident
    total = sum(p.numel() for p in model.parameters())
    assert total < sum(dense_params.values())


def test_architectures_it_cannot_rotate_are_refused_before_any_work():
    model = tiny_model("gemma3")
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(ParameterError, match="slicegpt cannot prune 'gemma3_text': Gemma-3 normalises"):
        fuse_norms(model)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("arch", ["opt", "llama"])
def test_principal_directions_are_the_ones_kept(arch, windows, monkeypatch):
    """Slicing in the PCA basis loses less than slicing in a random orthonormal basis (the same code
    with ``pca`` replaced): the kept dimensions must be the high-variance ones."""
    import spap_lib.methods.slicegpt.slicing as slicing

    def err(model):
        before = _logits(_model(arch), windows[:2])
        rotate_and_slice(model, fuse_norms(model), windows, 16)
        return float((_logits(model, windows[:2]) - before).pow(2).mean())

    by_pca = err(_model(arch))
    g = torch.Generator().manual_seed(0)
    monkeypatch.setattr(slicing, "pca", lambda X: torch.linalg.qr(torch.randn(X.shape[-1], X.shape[-1], generator=g,
                                                                              dtype=torch.float64))[0])
    assert by_pca < 0.7 * err(_model(arch))


@pytest.mark.parametrize("arch", ["opt", "llama"])
def test_a_sliced_checkpoint_reloads_exactly_and_stock_loading_refuses_it(arch, windows, tmp_path):
    from transformers import AutoModelForCausalLM

    from spap_lib.methods.slicegpt.slicing import load_sliced, mark_sliced, plan_of

    model = _model(arch).float()
    layout = fuse_norms(model)
    dims = rotate_and_slice(model, layout, windows, 24)
    model.save_pretrained(tmp_path)
    mark_sliced(tmp_path, plan_of(model, layout, dims))
    again = load_sliced(tmp_path, torch.float32)
    torch.testing.assert_close(_logits(again, windows[:2]), _logits(model, windows[:2]), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="spap_sliced"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("arch", ["opt", "llama", "qwen2"])
def test_slicegpt_through_the_harness_prunes_saves_and_reloads(arch, windows, tiny_tokenizer, tmp_path):
    """``sl.prune(..., "slicegpt")`` and ``sl.save``: both sparsities in the report, the real parameter
    counts (shortcuts included, the untied head counted), a checkpoint ``sl.load`` rebuilds exactly."""
    import spap_lib as sl
    from spap_lib.evaluation.data import Calibration
    from spap_lib.model.adapters import get_adapter
    from spap_lib.model.loading import Loaded
    from spap_lib.model.sources import ModelSource

    model = _model(arch).float()
    loaded = Loaded(model, tiny_tokenizer, get_adapter(model), ModelSource("tiny", "dir", "-"), torch.device("cpu"))
    calib = Calibration(windows, torch.arange(len(windows)), "validation", "fixture", 10_000, 0)
    report = sl.prune(loaded, calib, "slicegpt", 0.25, progress=False)
    sp = report["sparsity"]
    assert sp["requested"] == 0.25 and "32 -> 24" in sp["definition"]
    decoder = sum(p.numel() for p in (model.model.decoder.layers if arch == "opt" else model.model.layers).parameters())
    assert report["params"]["pruned"]["decoder"] == decoder
    assert sp["achieved_decoder"] == pytest.approx(1 - decoder / report["params"]["dense"]["decoder"])
    assert sp["achieved_decoder"] < 0.25  # the shortcut matrices are parameters too
    out = sl.save(loaded, report, tmp_path / "sliced")
    again = sl.load(str(out), device="cpu")
    torch.testing.assert_close(_logits(again.model, windows[:2]), _logits(model, windows[:2]), rtol=0, atol=1e-5)
    assert again.param_counts() == report["params"]["pruned"]
    with pytest.raises(ParameterError, match="loads resident only"):
        sl.load(str(out), device="cpu", offload="disk")


def test_slicegpt_in_the_grid_records_both_sparsities(tiny_tokenizer, windows, tmp_path):
    from test_grid import _grid

    from spap_lib.artifact.grid import Variant, run_grid

    g = _grid("llama", tiny_tokenizer, windows)
    g.resume_root = tmp_path / "progress"  # as 03 runs it: SliceGPT gets no resume folder (it refuses one)
    table = run_grid(g, [Variant.parse("slicegpt"), Variant.parse("fasp")], [0.25], [16], 2, tmp_path / "t.csv")
    row = table[table["label"] == "slicegpt"].iloc[0]
    assert row["sparsity"] == 0.25 and 0 < row["achieved_sparsity"] < 0.25 and row["mlp_channel_ratio"] == 0
    assert 1 < row["ppl"] < float("inf")
    # every cell starts from the pristine dense model: FASP after SliceGPT gives what FASP alone gives
    alone = run_grid(_grid("llama", tiny_tokenizer, windows), [Variant.parse("fasp")], [0.25], [16], 2,
                     tmp_path / "alone.csv")
    assert table[table["label"] == "fasp"]["ppl"].iloc[0] == alone[alone["label"] == "fasp"]["ppl"].iloc[0]


def test_the_plan_knows_slicegpt():
    """Memory: the head copy only where embeddings are tied, the float64 PCA Gram; resident only."""
    from spap_lib.plan import plan

    tied = plan("qwen2.5-0.5b", method="slicegpt", nsamples=8, seqlen=512, device="cpu-2core", offload="none")
    untied = plan("llama-3.1-8b", method="slicegpt", nsamples=8, seqlen=512, device="cpu-2core", offload="none")
    assert "untied head copy" in tied.memory_gb and "untied head copy" not in untied.memory_gb
    assert untied.memory_gb["PCA Gram (float64)"] == pytest.approx((2 * 4096**2 * 8 + 4096 * 4096 * 8) / 2**30)
    assert "PCA (float64 Gram sums, eigh)" in tied.seconds
    assert not plan("qwen2.5-0.5b", method="slicegpt", nsamples=8, seqlen=512, device="cpu-2core",
                       offload="disk").fits


def test_settings_its_pipeline_does_not_read_are_refused_alike_by_the_check_and_the_prune(windows, tiny_tokenizer,
                                                                                          tmp_path):
    """One refusal, written once on the method (``check_settings``, ``offloads``): ``check_run`` gives it before any
    weight is read, and ``sl.prune`` gives the same words on a loaded model."""
    import spap_lib as sl
    from spap_lib.evaluation.data import Calibration
    from spap_lib.model.adapters import get_adapter
    from spap_lib.model.loading import Loaded
    from spap_lib.model.sources import ModelSource

    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "m")
    tiny_tokenizer.save_pretrained(tmp_path / "m")
    loaded = Loaded(model, tiny_tokenizer, get_adapter(model), ModelSource("tiny", "dir", "-"), torch.device("cpu"))
    calib = Calibration(windows, torch.arange(len(windows)), "validation", "fixture", 10_000, 0)
    words = r"method 'slicegpt' does not take round_to \(it prunes the whole model at once"
    with pytest.raises(ParameterError, match=words):
        sl.check_run(str(tmp_path / "m"), method="slicegpt", sparsity=0.25, round_to=8)
    with pytest.raises(ParameterError, match=words):
        sl.prune(loaded, calib, "slicegpt", 0.25, round_to=8, progress=False)
    with pytest.raises(ParameterError, match="method 'slicegpt' needs offload 'none'"):
        sl.check_run(str(tmp_path / "m"), method="slicegpt", sparsity=0.25, offload="cpu")
    assert sl.check_run(str(tmp_path / "m"), method="slicegpt", sparsity=0.25).offload == "none"
    assert sl.prune(loaded, calib, "slicegpt", 0.0, round_to=8, progress=False)["sparsity"]["requested"] == 0.0
