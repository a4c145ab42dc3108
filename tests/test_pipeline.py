"""Invariants on tiny random OPT, Llama, Qwen2 and Gemma-3 models."""
import json

import torch
from conftest import calibration
from transformers import AutoModelForCausalLM

import spap_lib as sl
from spap_lib.artifact.manifest import MANIFEST
from spap_lib.methods import LayerProblem
from spap_lib.model.capture import Batching, first_layer_inputs, replay
from spap_lib.numerics import bf16
from spap_lib.pipeline.sequential import RunSettings

FAST = {"K": 10, "am_iters": 2, "adam_steps": 3, "batch_tokens": 32}




def test_replay_reproduces_the_model(loaded, windows):
    """Layer-by-layer replay from captured layer-0 inputs and kwargs equals the full forward."""
    layers = loaded.adapter.layers()
    with torch.no_grad():
        ref = loaded.model(input_ids=windows, output_hidden_states=True).hidden_states
    hidden, kwargs = first_layer_inputs(loaded.model, layers, windows, batch_size=3, device="cpu")
    torch.testing.assert_close(hidden, ref[0])
    for i, layer in enumerate(layers[:-1]):  # the last entry of hidden_states has the final norm
        hidden, _ = replay(layer, hidden, {b: kw[i] for b, kw in kwargs.items()}, 3)
        torch.testing.assert_close(hidden, ref[i + 1], rtol=1e-4, atol=1e-4)
    assert not any("forward" in layer.__dict__ for layer in layers)


def test_a_pruned_layer_replays_with_the_attention_outputs_it_kept(loaded, windows, monkeypatch):
    """Propagating, a layer's first replay stops at its MLP and keeps its attention's outputs; once the MLP is
    pruned, the replay that reuses them skips the attention and gives the full replay's outputs to the bit,
    written over the kept ones, batch by batch (a last batch smaller than the rest)."""
    ad, layers = loaded.adapter, loaded.adapter.layers()
    hidden, kwargs = first_layer_inputs(loaded.model, layers, windows, batch_size=3, device="cpu")
    layer, kw = layers[1], {b: k[1] for b, k in kwargs.items()}
    attention = ad.attention_module(layer)
    computed = []
    original = type(attention).forward

    def counted(self, *a, **k):
        computed.append(1)
        return original(self, *a, **k)

    monkeypatch.setattr(type(attention), "forward", counted)
    kept, X = replay(layer, hidden, kw, 3, watch=ad.mlp_input_module(layer), outputs=False, attention=attention)
    assert kept.shape == hidden.shape and X.shape[0] == hidden.shape[0] * hidden.shape[1]
    ad.set_mlp(layer, ad.get_mlp(layer).select(torch.arange(0, ad.get_mlp(layer).width, 3)))
    full, _ = replay(layer, hidden, kw, 3)
    computed.clear()
    reused, _ = replay(layer, hidden, kw, 3, attention=attention, reuse=kept)
    assert not computed  # the attention was not run again
    assert reused is kept and torch.equal(reused, full)
    assert "forward" not in attention.__dict__ and not attention._forward_hooks


def test_shrunk_model_equals_masked_dense_model(loaded, windows):
    ad = loaded.adapter
    keep = torch.tensor([0, 3, 5, 6, 10, 17, 33, 40, 63])
    masked = AutoModelForCausalLM.from_config(loaded.model.config).eval()
    masked.load_state_dict(loaded.model.state_dict())
    mad = sl.get_adapter(masked)
    for layer, mlayer in zip(ad.layers(), mad.layers()):
        ad.set_mlp(layer, ad.get_mlp(layer).select(keep))
        out = getattr(mad.mlp_owner(mlayer), mad.out_name)
        drop = torch.ones(out.in_features, dtype=torch.bool)
        drop[keep] = False
        with torch.no_grad():
            out.weight[:, drop] = 0  # masking the output projection's columns silences the channel
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(windows).logits, masked(windows).logits, rtol=1e-5, atol=1e-5)


def test_exact_parameter_counts(loaded, arch):
    cfg = loaded.model.config
    d, n, L = cfg.hidden_size, 64, cfg.num_hidden_layers
    per_channel = 2 * d + 1 if arch == "opt" else 3 * d  # fc1 row + bias entry + fc2 col | gate, up, down
    plan = sl.plan_sparsity(loaded.adapter, 0.25)
    assert plan.params_per_channel == per_channel
    mlp = L * ((2 * n * d + n + d) if arch == "opt" else 3 * n * d)
    assert loaded.adapter.mlp_params() == mlp
    before = loaded.param_counts()
    for layer in loaded.adapter.layers():
        loaded.adapter.set_mlp(layer, loaded.adapter.get_mlp(layer).select(torch.arange(n - plan.n_remove)))
    after = loaded.param_counts()
    assert before["decoder"] - after["decoder"] == L * plan.n_remove * per_channel
    assert before["total"] - after["total"] == L * plan.n_remove * per_channel
    assert abs((1 - after["decoder"] / before["decoder"]) - 0.25) < per_channel * L / before["decoder"]


def test_prune_save_and_stock_reload(loaded, windows, byte_tokenizer, tmp_path):
    loaded.tokenizer = byte_tokenizer
    report = sl.prune(loaded, calibration(windows), "spap", 0.3, hparams=FAST, progress=False)
    width = report["sparsity"]["mlp_width"]["pruned"]
    assert width < 64 and all(loaded.adapter.width(layer) == width for layer in loaded.adapter.layers())
    out = sl.save(loaded, report, tmp_path / "pruned")
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()  # stock transformers, no spap
    with torch.no_grad():
        torch.testing.assert_close(reloaded(windows).logits, loaded.model(windows).logits, rtol=1e-5, atol=1e-5)
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["method"] == "spap" and manifest["sparsity"]["requested"] == 0.3
    assert manifest["versions"]["torch"] and "git_revision" in manifest
    assert manifest["host"]["cpu"]  # the processor: CPU kernels, and a CPU run's last digits, differ between them
    assert manifest["host"]["bf16_products"] == bf16.kernels("cpu")  # which kernels the bf16 products took
    # no temp dirs left; the lock beside the checkpoint (``files.records_lock``) stays, as lock files do
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".") and not p.name.endswith(".lock")]
    kept = json.loads((out / "spap_plan.json").read_text())["kept_channels"]
    assert len(kept) == len(loaded.adapter.layers()) and all(len(k) == width for k in kept)


def test_no_hooks_left_behind(loaded, windows):
    sl.prune(loaded, calibration(windows), "spap", 0.2, hparams=FAST, progress=False)
    for m in loaded.model.modules():
        assert not m._forward_pre_hooks and not m._forward_hooks and "forward" not in m.__dict__


def test_calibration_cache_round_trip(windows, tmp_path):
    from spap_lib.artifact.caches import load_calibration, save_calibration

    calib = calibration(windows)
    key = {"model": "sha256:1", "data": "d", "nsamples": 4, "seqlen": 24, "seed": 0, "code": "c"}
    save_calibration(tmp_path / "calibration.pt", calib, key)
    back = load_calibration(tmp_path / "calibration.pt", key)
    assert torch.equal(back.windows, calib.windows) and back.split == "validation"
    for other in ({"nsamples": 8}, {"model": "sha256:2"}, {"data": "e"}, {"code": "d"}):  # another key: recompute
        assert load_calibration(tmp_path / "calibration.pt", {**key, **other}) is None
    assert [p.name for p in tmp_path.iterdir()] == ["calibration.pt"]


def test_without_propagation_layers_see_dense_activations(loaded, windows):
    """propagate=False: the last layer is pruned exactly as if its inputs came from the dense model."""
    dense_model = AutoModelForCausalLM.from_config(loaded.model.config).eval()
    dense_model.load_state_dict(loaded.model.state_dict())
    hp = {**FAST, "am_iters": 0}
    report = sl.prune(loaded, calibration(windows), "spap", 0.3, hparams=hp, propagate=False, progress=False)
    ad = sl.get_adapter(dense_model)
    last = len(ad.layers()) - 1
    with torch.no_grad():
        hidden = dense_model(input_ids=windows, output_hidden_states=True).hidden_states[last]
    _, kwargs = first_layer_inputs(dense_model, ad.layers(), windows, batch_size=4, device="cpu")
    layer = ad.layers()[last]
    _, X = replay(layer, hidden, {4: kwargs[4][last]}, 4, watch=ad.mlp_input_module(layer))
    plan = sl.plan_sparsity(ad, 0.3)
    method = sl.get_method("spap", **hp)
    expected = method.prune(LayerProblem.of(method, ad.get_mlp(layer), X.float(), plan.n_remove))
    assert report["kept_channels"][last] == expected.keep.tolist()


def test_pruning_a_copy_leaves_the_loaded_model_alone(loaded, windows):
    with torch.no_grad():
        before = loaded.model(windows).logits
    copied = loaded.copy()
    sl.prune(copied, calibration(windows), "magnitude", 0.3, progress=False)
    assert copied.adapter.width(copied.adapter.layers()[0]) < loaded.adapter.width(loaded.adapter.layers()[0])
    assert copied.tokenizer is loaded.tokenizer and copied.source is loaded.source
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(windows).logits, before, rtol=0, atol=0)


def test_layer0_inputs_are_freed_once_layer0_is_done(loaded, windows, monkeypatch):
    """Memory per layer: the captured layer-0 inputs ([n, seqlen, d]) do not live through the whole run."""
    import gc
    import weakref

    from spap_lib.pipeline import sequential as pipeline

    refs = []
    real_capture = pipeline.first_layer_inputs

    def capture(*a, **k):
        hidden, kwargs = real_capture(*a, **k)
        refs.append(weakref.ref(hidden))
        return hidden, kwargs

    alive_at = {}
    method = sl.get_method("spap", **{**FAST, "am_iters": 0})
    real_prune = method.prune

    def prune(problem):
        gc.collect()
        alive_at[problem.layer_index] = refs[0]() is not None
        return real_prune(problem)

    monkeypatch.setattr(pipeline, "first_layer_inputs", capture)
    monkeypatch.setattr(method, "prune", prune)
    plan = sl.plan_sparsity(loaded.adapter, 0.2)
    sl.prune_model(loaded.adapter, windows, method, plan, run=RunSettings(progress=False))
    assert alive_at == {0: True, 1: False, 2: False}


def test_mlp_inputs_are_written_into_the_store_a_batch_at_a_time(loaded, windows):
    """``replay`` writes what the watched module sees into one tensor from ``inputs`` (an onloader's
    ``calibration``), batch by batch: the rows of every batch, in order, also when the pass stops at the MLP."""
    from spap_lib.model.capture import capture_inputs

    ad = loaded.adapter
    layer = ad.layers()[1]
    hidden, kwargs = first_layer_inputs(loaded.model, ad.layers(), windows, batch_size=3, device="cpu")
    with capture_inputs(ad.mlp_input_module(layer)) as seen, torch.no_grad():
        for start in range(0, len(hidden), 3):
            h = hidden[start:start + 3]
            layer(h, **kwargs[h.shape[0]][1])
    expected = torch.cat(seen)
    stores = []

    def store(shape, dtype):
        stores.append(torch.full(shape, float("nan"), dtype=dtype))
        return stores[-1]

    for outputs in (True, False):
        out, X = replay(layer, hidden, {b: kw[1] for b, kw in kwargs.items()}, Batching(3, inputs=store),
                        watch=ad.mlp_input_module(layer), outputs=outputs)
        assert X is stores[-1] and torch.equal(X, expected) and (out is None) == (not outputs)
    assert len(stores) == 2


def test_a_copy_of_an_mlp_can_wait_elsewhere():
    """``MLP.clone(device)`` copies (the update keeps its start and best round in host memory); ``MLP.to`` moves
    without copying what is already there."""
    from spap_lib.model.adapters import MLP

    mlp = MLP([torch.randn(6, 4), torch.randn(6, 4)], [None, torch.randn(6)], torch.randn(4, 6), None,
              torch.nn.functional.silu, glu=True)
    copy = mlp.clone("cpu")
    assert copy.W_out is not mlp.W_out and copy.W_out.data_ptr() != mlp.W_out.data_ptr()
    assert all(torch.equal(a, b) for a, b in zip([*copy.W_in, copy.W_out, copy.b_in[1]],
                                                [*mlp.W_in, mlp.W_out, mlp.b_in[1]]))
    assert copy.b_in[0] is None and copy.b_out is None
    assert mlp.to("cpu").W_out.data_ptr() == mlp.W_out.data_ptr()
    x = torch.randn(5, 4)
    assert torch.equal(copy(x), mlp(x))
