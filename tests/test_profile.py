"""05_profile's bookkeeping without timing anything: the bytes bound and the pooled, order-alternating rounds."""
import pytest

from spap_lib import profile as prof


def test_rounds_alternate_the_order_and_pool_every_run(monkeypatch):
    calls = []

    def fake(source, **kwargs):
        calls.append(source)
        t = float(len(calls))  # a machine that slows down steadily: later runs take longer
        return {"seconds_all": [t, t + 0.5], "peak_mem_mb": 100.0 + len(calls), "weights_read": 1}

    monkeypatch.setattr(prof, "profile", fake)
    out = prof.profile_rounds({"dense": "d", "20%": "p"}, rounds=3, repeats=2)
    assert calls == ["d", "p", "p", "d", "d", "p"]  # A B, B A, A B: drift lands on both alike
    assert list(out) == ["dense", "20%"]
    assert out["dense"]["runs"] == 6 and out["dense"]["seconds_all"] == [1, 1.5, 4, 4.5, 5, 5.5]
    assert out["dense"]["seconds_median"] == 4.25 and out["20%"]["seconds_median"] == 3.25
    assert out["20%"]["seconds_min"] == 2 and out["20%"]["seconds_max"] == 6.5
    assert out["dense"]["peak_mem_mb"] == 105.0  # the largest peak over its rounds
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        prof.profile_rounds({"dense": "d"}, rounds=0)


def test_bytes_bound():
    assert prof.bytes_bound(100, 80) == pytest.approx(1.25)


@pytest.mark.parametrize("method", ["magnitude", "wanda_sp"])
def test_kept_channels_reapplied_to_dense_weights_give_the_pruned_model(arch, windows, method):
    """05 profiles a variant from its kept channels alone (no checkpoint): re-applied to the dense
    weights, a score method's pruning (no refit) is the same model, shapes and logits."""
    import copy

    import torch
    from conftest import tiny_model

    import spap_lib as sl

    dense = tiny_model(arch)
    pruned = copy.deepcopy(dense)
    adapter = sl.get_adapter(pruned)
    plan = sl.plan_sparsity(adapter, 0.3)
    run = sl.prune_model(pruned, adapter, windows, sl.get_method(method), plan, device="cpu", progress=False)
    sl.get_adapter(dense).keep_channels(run["kept_channels"])
    assert [sl.get_adapter(dense).width(layer) for layer in sl.get_adapter(dense).layers()] == \
        [len(k) for k in run["kept_channels"]]
    assert dense.config.to_dict() == pruned.config.to_dict()
    with torch.no_grad():
        torch.testing.assert_close(dense(windows).logits, pruned(windows).logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="kept_channels lists 1 layers, the model has 3"):
        sl.get_adapter(dense).keep_channels(run["kept_channels"][:1])


@pytest.mark.parametrize("arch", ["opt", "llama"])
def test_a_slicegpt_variant_has_the_shapes_slicegpt_gives(arch, windows):
    """05 profiles SliceGPT from its plan alone (config + slicing fraction): the same shapes, hence the
    same parameter count and bytes per token, as a real SliceGPT prune."""
    import torch
    from conftest import tiny_model

    from spap_lib.slicing import fuse_norms, plan_for, rotate_and_slice, shape_like, sliced_dim

    real = tiny_model(arch)
    rotate_and_slice(real, fuse_norms(real), windows, sliced_dim(32, 0.25, 8))
    shaped = shape_like(tiny_model(arch), plan_for(tiny_model(arch).config, 0.25))
    assert {n: p.shape for n, p in shaped.named_parameters()} == {n: p.shape for n, p in real.named_parameters()}
    assert prof.weights_read_per_token(shaped) == prof.weights_read_per_token(real)
    with torch.no_grad():
        assert torch.isfinite(shaped(input_ids=windows[:1]).logits).all()
