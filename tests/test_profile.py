"""05_profile: the decode paths (eager, static cache, compiled) and their bookkeeping: the bytes bound, the pooled,
order-alternating rounds and the table."""
import pytest

from spap_lib.evaluation import profile as prof


def test_rounds_alternate_the_order_and_pool_every_run(monkeypatch):
    calls = []

    def fake(source, **kwargs):
        calls.append(source)
        t = float(len(calls))  # a machine that slows down steadily: later runs take longer
        return {"seconds_all": [t, t + 0.5], "prefill_all": [0.1, 0.1], "decode_all": [t - 0.1, t + 0.4],
                "peak_mem_mb": 100.0 + len(calls), "weights_read": 1}

    monkeypatch.setattr(prof, "profile", fake)
    out = prof.profile_rounds({"dense": "d", "20%": "p"}, rounds=3, repeats=2)
    assert calls == ["d", "p", "p", "d", "d", "p"]  # A B, B A, A B: drift lands on both alike
    assert list(out) == ["dense", "20%"]
    assert out["dense"]["runs"] == 6 and out["dense"]["seconds_all"] == [1, 1.5, 4, 4.5, 5, 5.5]
    assert out["dense"]["seconds_median"] == 4.25 and out["20%"]["seconds_median"] == 3.25
    assert out["20%"]["seconds_min"] == 2 and out["20%"]["seconds_max"] == 6.5
    assert out["dense"]["peak_mem_mb"] == 105.0  # the largest peak over its rounds
    assert out["dense"]["decode_all"] == pytest.approx([0.9, 1.4, 3.9, 4.4, 4.9, 5.4])
    assert len(out["dense"]["prefill_all"]) == 6
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        prof.profile_rounds({"dense": "d"}, rounds=0)


def test_bytes_bound():
    assert prof.bytes_bound(100, 80) == pytest.approx(1.25)


def test_the_table_times_the_decode_per_token_and_names_its_path():
    variants = {"dense": prof.Variant("m"), "30%": prof.Variant("m", [[0]], 0.3)}
    results = {label: {"device": "cuda:0", "threads": 1, "decode": "compiled", "decode_reason": "why",
                       "seconds_median": 9.0, "seconds_min": 9.0, "seconds_max": 9.0, "runs": 2, "peak_mem_mb": 1.0,
                       "prefill_all": [0.5, 0.7], "decode_all": decode, "weights_read": read, "bytes_read": 2 * read}
               for label, decode, read in (("dense", [2.0, 2.2], 1000), ("30%", [1.6, 1.6], 700))}
    table = prof.summary_table("m", "magnitude", variants, results, new_tokens=11).set_index("variant")
    assert table.loc["dense", "prefill_ms"] == pytest.approx(600)
    assert table.loc["dense", "decode_ms_per_token"] == pytest.approx(210)  # median 2.1 s over 10 steps
    assert table.loc["dense", "tokens_per_s"] == pytest.approx(1000 / 210)
    assert table.loc["30%", "bandwidth_gb_s"] == pytest.approx(1400 / 0.16 / 1e9)  # bytes/token x tokens/s
    assert table.loc["30%", "speedup"] == pytest.approx(2.1 / 1.6)  # the decode's, not prefill's
    assert table.loc["30%", "of_bound"] == pytest.approx((2.1 / 1.6 - 1) / (1000 / 700 - 1))
    assert (table["decode"] == "compiled").all()


def test_the_static_cache_gives_the_dynamic_caches_greedy_tokens(arch):
    """Every decode step's logits (not only the argmax: a random tiny model may repeat one token) are the same
    with the static cache as with the dynamic one, and the tokens are generate's."""
    import torch
    from conftest import tiny_model
    from transformers import StaticCache

    model = tiny_model(arch).eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(0))

    def recorded(logits):
        def step(**kwargs):
            out = model(**kwargs)
            logits.append(out.logits[:, -1].clone())
            return out
        return step
    dynamic_logits, static_logits = [], []
    dynamic = prof.greedy_tokens(model, prompt, 12, step=recorded(dynamic_logits))
    static = prof.greedy_tokens(model, prompt, 12, cache=StaticCache(config=model.config, max_cache_len=17),
                                step=recorded(static_logits))
    reference = model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(dynamic, static) and torch.equal(dynamic, reference[:, 5:])
    assert len(dynamic_logits) == 11
    torch.testing.assert_close(torch.cat(static_logits), torch.cat(dynamic_logits), rtol=1e-5, atol=1e-5)


def test_compiled_and_eager_timings_name_their_path_and_agree_on_the_tokens(monkeypatch):
    """Both paths are timed and named (prefill and decode apart); a compile that fails falls back to the eager
    path with a warning naming why, never a crash."""
    import torch
    from conftest import tiny_model

    model = tiny_model("llama").eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(1))
    runs = {path: prof.time_generation(model, prompt, 8, repeats=2, warmup=0, decode=path)
            for path in ("eager", "compiled")}
    for path, res in runs.items():
        assert res["decode"] == path and res["decode_reason"] == "asked for"
        assert len(res["prefill_all"]) == len(res["decode_all"]) == 2 and min(res["decode_all"]) > 0
    assert runs["eager"]["tokens"] == runs["compiled"]["tokens"]
    assert prof.decode_path(torch.device("cpu"))[0] == "eager"
    assert prof.decode_path(torch.device("cuda"))[0] == "compiled"
    with pytest.raises(ValueError, match="decode 'graphs' is not a decode path"):
        prof.decode_path(torch.device("cpu"), "graphs")

    def uncompilable(model, device):
        def step(**kwargs):
            raise RuntimeError("Unsupported: an operator dynamo cannot trace")
        return step

    monkeypatch.setattr(prof, "_compiled_step", uncompilable)
    with pytest.warns(UserWarning, match="compiling the decode step failed .*dynamo cannot trace.* eager path"):
        res = prof.time_generation(model, prompt, 8, repeats=1, warmup=0, decode="compiled")
    assert res["decode"] == "eager" and "compile failed" in res["decode_reason"]
    assert res["tokens"] == runs["eager"]["tokens"]


@pytest.mark.parametrize("method", ["magnitude", "wanda_sp"])
def test_kept_channels_reapplied_to_dense_weights_give_the_pruned_model(arch, windows, method):
    """05 profiles a variant from its kept channels alone (no checkpoint): re-applied to the dense
    weights, a score method's pruning (no refit) is the same model, shapes and logits."""
    import copy

    import torch
    from conftest import tiny_model

    import spap_lib as sl
    from spap_lib.pipeline.sequential import RunSettings

    dense = tiny_model(arch)
    pruned = copy.deepcopy(dense)
    adapter = sl.get_adapter(pruned)
    plan = sl.plan_sparsity(adapter, 0.3)
    run = sl.prune_model(adapter, windows, sl.get_method(method), plan, run=RunSettings(progress=False))
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

    from spap_lib.methods.slicegpt.slicing import fuse_norms, plan_for, rotate_and_slice, shape_like, sliced_dim

    real = tiny_model(arch)
    rotate_and_slice(real, fuse_norms(real), windows, sliced_dim(32, 0.25, 8))
    shaped = shape_like(tiny_model(arch), plan_for(tiny_model(arch).config, 0.25))
    assert {n: p.shape for n, p in shaped.named_parameters()} == {n: p.shape for n, p in real.named_parameters()}
    assert prof.weights_read_per_token(shaped) == prof.weights_read_per_token(real)
    with torch.no_grad():
        assert torch.isfinite(shaped(input_ids=windows[:1]).logits).all()
