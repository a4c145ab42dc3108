"""Every registered method on tiny random models, and the properties each one promises."""
import copy
import json
import re
from pathlib import Path

import pytest
import torch
from conftest import calibration, prune_save_reload
from transformers import AutoModelForCausalLM

import spap_lib as sl
from spap_lib.methods import LayerProblem
from spap_lib.methods.parts import allocation
from spap_lib.methods.spap.algorithm import SPAP
from spap_lib.methods.spap.alternating import calibration_error
from spap_lib.model.capture import first_layer_inputs, replay
from spap_lib.numerics.stats import ChannelStats
from spap_lib.pipeline.sequential import RunSettings, dense_stats

QUIET = RunSettings(progress=False)

FAST = {"K": 5, "am_iters": 2, "adam_steps": 2, "batch_tokens": 32}
HPARAMS = {"spap": FAST, "spap_gd": FAST, "spap_no_update": {"K": 5}}




def _hparams(method, arch):
    extra = {"bias": False} if method == "flap" and arch in ("qwen2", "gemma3") else {}
    return {**HPARAMS.get(method, {}), **extra}


@pytest.mark.parametrize("method", sorted(m for m in sl.METHODS if sl.METHODS[m].pipeline == "layers"))  # MLP channels
def test_every_method_prunes_saves_and_reloads(method, loaded, arch, windows, byte_tokenizer, tmp_path):
    """Same budget for every method; the saved checkpoint reloads to the same logits."""
    prune_save_reload(loaded, method, _hparams(method, arch), windows, byte_tokenizer, tmp_path)


COMPOSITIONS = ["spap/select=act_norm", "spap/select=wanda,allocation=error", "spap/select=wanda,update=gd",
                "spap/select=fluctuation,update=none", "spap/score_scale=layer", "spap/allocation=error",
                "fasp/select=magnitude,allocation=global", "spap_no_update/allocation=angular"]


@pytest.mark.parametrize("label", COMPOSITIONS)
def test_any_composition_prunes_saves_and_reloads(label, loaded, windows, byte_tokenizer, tmp_path):
    """A composition is one label (as a grid, the CLI or 02 gives it): it spends exactly the plan and its
    checkpoint reloads to the same logits, whatever its selection, allocation and update."""
    from spap_lib.artifact.grid import Variant

    variant = Variant.parse(label)
    method = sl.get_method(variant.method, **variant.hparams)
    fast = {k: v for k, v in FAST.items() if k in method.effective_hparams()}  # the parts it has
    assert method.parts() == {**sl.get_method(variant.method).parts(),
                              **{k: v for k, v in variant.hparams.items() if k in ("select", "allocation", "update")}}
    prune_save_reload(loaded, variant.method, {**fast, **variant.hparams}, windows, byte_tokenizer, tmp_path)


def test_presets_reproduce_their_methods():
    """Every method is a preset of the parts (``methods.parts``): each keeps the channels, and ends with the
    weights, pinned in tests/data/presets.json (``python tests/presets.py`` says how to rewrite it for a
    change meant to alter a result). The weights' sums may move by what CPUs' float32 kernels differ by
    (``presets.TOLERANCE``)."""
    from presets import ARCHS, CASES, snapshot, tolerance

    reference = json.loads((Path(__file__).parent / "data" / "presets.json").read_text())
    assert set(reference) == {f"{a}/{label}" for a in ARCHS for label in CASES}
    for key, expected in reference.items():
        arch, label = key.split("/", 1)
        got = snapshot(arch, *CASES[label])
        assert got["kept"] == expected["kept"], key
        for i, (layer, pinned) in enumerate(zip(got["sums"], expected["sums"], strict=True)):
            scale = max(abs_sum for _, abs_sum in pinned)
            moved = max(abs(a - b) for tensor, ref in zip(layer, pinned, strict=True) for a, b in zip(tensor, ref))
            assert moved <= tolerance(label) * scale, f"{key} layer {i}: sums moved {moved:.3g} of {scale:.3g}"


def test_error_allocation_spends_the_budget_where_channels_matter_least(windows):
    """The "error" allocation meets the budget exactly, never empties a layer, and takes a layer's channels that do
    not matter first (half of layer 1's are dead: zero input rows; their removal costs nothing in any weighting).
    Measured against each layer's own output (``error_weight="token"``), that layer loses more than the others;
    against the residual stream (the default) a layer's share depends on the stream too (the test below)."""
    from conftest import tiny_model

    from spap_lib.model.loading import Loaded
    from spap_lib.model.sources import ModelSource

    gen = torch.Generator().manual_seed(0)
    curves = [[(r, float(torch.rand(1, generator=gen)) * r**p) for r in range(0, 50, 7)] + [(49, 60.0)]
              for p in (0.5, 1.0, 2.0, 1.5)]  # concave, linear, convex: the hull makes them all convex
    for total in (0, 1, 77, 4 * 49):
        counts = allocation.by_error(curves, total)
        assert sum(counts) == total and all(0 <= c <= 49 for c in counts)
    with pytest.raises(ValueError, match="cannot remove"):
        allocation.by_error(curves, 4 * 49 + 1)
    with pytest.raises(ValueError, match="layer 1's error curve is not finite"):
        allocation.by_error([curves[0], [(0, 0.0), (49, float("nan"))]], 10)
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[:32] = 0  # 32 of 64 channels output nothing
    plan = sl.plan_sparsity(sl.get_adapter(model), 0.3)
    for weight in ("residual", "token"):
        fresh = copy.deepcopy(model)
        loaded = Loaded(fresh, None, sl.get_adapter(fresh), ModelSource("t", "dir", "-"), torch.device("cpu"))
        report = sl.prune(loaded, calibration(windows), "fasp", 0.3,
                          hparams={"allocation": "error", "error_weight": weight}, progress=False)
        removed = [layer["removed"] for layer in report["layers"]]
        assert sum(removed) == 3 * plan.n_remove and min(64 - r for r in removed) >= 1
        assert removed[1] >= 32, weight
        assert 0 < report["allocation_seconds"] < report["seconds"]  # the curve pass and the allocation, timed
    assert removed[1] > max(removed[0], removed[2])  # "token"
    # round_to: every layer's kept width a multiple, the same total, the dead channels still taken first
    fresh = tiny_model("llama")
    with torch.no_grad():
        fresh.model.layers[1].mlp.up_proj.weight[:32] = 0
    loaded = Loaded(fresh, None, sl.get_adapter(fresh), ModelSource("t", "dir", "-"), torch.device("cpu"))
    plan = sl.plan_sparsity(loaded.adapter, 0.3, round_to=8)
    report = sl.prune(loaded, calibration(windows), "fasp", 0.3, hparams={"allocation": "error"}, round_to=8,
                      progress=False)
    kept = [64 - layer["removed"] for layer in report["layers"]]
    assert sum(kept) == 3 * (64 - plan.n_remove) and all(k % 8 == 0 and k >= 8 for k in kept)
    assert kept[1] <= 32


def test_error_curves_weigh_every_token_by_its_own_output_energy():
    """``error_weight="token"`` measures each token's error relative to its own output energy: one
    token made massive (its input x1000, as massive activations are) barely moves the curve, while the summed
    ``"energy"`` curve becomes that one token's. The per-token Gram pass is the explicitly weighted Gram matrix."""
    from conftest import tiny_model

    from spap_lib.numerics.linalg import gram

    mlp = sl.get_adapter(model := tiny_model("llama")).get_mlp(model.model.layers[1])
    X = torch.randn(512, mlp.W_out.shape[0], generator=torch.Generator().manual_seed(0))
    massive = X.clone()
    massive[0] *= 1000
    with torch.no_grad():
        Z = mlp.hidden(massive)
        w = (Z @ mlp.W_out.T).double().square().sum(1).rsqrt()
        explicit = (Z.double() * w[:, None]).T @ (Z.double() * w[:, None])
        assert torch.allclose(gram(mlp, massive, 100, weigh="output"), explicit, rtol=1e-4,
                              atol=1e-5 * float(explicit.abs().max()))
    stats = ChannelStats.of(mlp, X, 100)  # the same ranking for every curve: only the weighting differs

    def curve(weight, X):
        errors = [e for _, e in SPAP(error_weight=weight).error_curve(mlp, X, 100, stats=stats)[1]]
        return torch.tensor(errors)

    token = curve("token", X)
    assert torch.all(curve("energy", X)[1:] > 0.01)  # channels matter to the ordinary tokens
    assert torch.allclose(curve("token", massive), token, atol=1e-3)
    assert torch.all(curve("energy", massive)[:-1] < 1e-3)  # flat until the last channel: the allocation's trap


@pytest.mark.parametrize("tokens", [4096, 300])
def test_an_error_curve_takes_the_channel_statistics_from_its_own_gram_pass(tokens):
    """Without statistics given, the curve's Gram pass sums them from its own ``Z`` when it reads every token: the same
    sums as ``ChannelStats.of`` bit for bit (the same chunks, the same float64 sums), so the same ranking and curve as
    with the statistics given; it reads them in no second forward. Where the curve reads a sample of the tokens
    (``error_tokens`` < N), the statistics still come from every token."""
    from conftest import tiny_model

    mlp = sl.get_adapter(model := tiny_model("llama")).get_mlp(model.model.layers[1])
    X = torch.randn(512, mlp.W_out.shape[0], generator=torch.Generator().manual_seed(0))
    residual = torch.rand(512, dtype=torch.float64) + 0.5
    method = SPAP(error_tokens=tokens)
    given = ChannelStats.of(mlp, X, 100)
    forwards, hidden = [], mlp.hidden
    mlp.hidden = lambda x: forwards.append(x.shape[0]) or hidden(x)
    taken, curve = method.error_curve(mlp, X, 100, residual)
    assert sum(forwards) == 512 + (tokens if tokens < 512 else 0)  # every token once, the sample once more
    mlp.hidden = hidden
    assert taken.N == given.N == 512
    assert torch.equal(taken.z_sum, given.z_sum) and torch.equal(taken.z_sq, given.z_sq)
    assert curve == method.error_curve(mlp, X, 100, residual, given)[1]


def test_residual_error_curves_measure_the_error_against_the_hidden_state_it_joins(windows):
    """``error_weight="residual"`` (the default): each token's error relative to the hidden state its MLP output is
    added to, averaged, and not divided by the layer's own output energy. Given each token's own output energy as
    that reference it is the ``"token"`` curve; a residual stream 100x as strong divides the curve by 100. Two copies
    of one layer then differ only there, and the allocation takes more channels from the one whose errors
    land in the stronger stream; a whole prune meets the budget."""
    from conftest import tiny_model

    from spap_lib.model.loading import Loaded
    from spap_lib.model.sources import ModelSource

    mlp = sl.get_adapter(model := tiny_model("llama")).get_mlp(model.model.layers[1])
    X = torch.randn(512, mlp.W_out.shape[0], generator=torch.Generator().manual_seed(0))
    stats = ChannelStats.of(mlp, X, 100)
    with torch.no_grad():
        own = mlp(X).double().square().sum(1)

    def curve(weight, residual=None):
        return torch.tensor([e for _, e in SPAP(error_weight=weight).error_curve(mlp, X, 100, residual, stats)[1]])

    token = curve("token")
    assert torch.allclose(curve("residual", own), token, rtol=1e-4, atol=1e-7)
    assert torch.allclose(curve("residual", 100 * own), token / 100, rtol=1e-4, atol=1e-9)
    with pytest.raises(ValueError, match="residual"):
        curve("residual")
    weak, strong = (SPAP(error_weight="residual").error_curve(mlp, X, 100, c * own, stats)[1] for c in (1.0, 100.0))
    removed = allocation.by_error([weak, strong], 2 * 32)
    assert sum(removed) == 64 and removed[1] > 32 > removed[0]
    loaded = Loaded(model, None, sl.get_adapter(model), ModelSource("t", "dir", "-"), torch.device("cpu"))
    plan = sl.plan_sparsity(loaded.adapter, 0.3)
    report = sl.prune(loaded, calibration(windows), "fasp", 0.3,
                      hparams={"allocation": "error", "error_weight": "residual"}, progress=False)
    removed = [layer["removed"] for layer in report["layers"]]
    assert sum(removed) == 3 * plan.n_remove and min(64 - r for r in removed) >= 1


def test_nonuniform_checkpoint_is_refused_by_stock_loading(tmp_path, windows, tiny_tokenizer):
    """Per-layer widths cannot load silently wrong: stock from_pretrained refuses the shapes."""
    from conftest import tiny_model

    from spap_lib.model.loading import Loaded
    from spap_lib.model.sources import ModelSource

    model = tiny_model("llama")
    loaded = Loaded(model, tiny_tokenizer, sl.get_adapter(model), ModelSource("t", "dir", "-"), torch.device("cpu"))
    # scale is in token-summed angular distance; a few tokens need a small one to spread the widths
    report = sl.prune(loaded, calibration(windows), "cfsp", 0.3, hparams={"scale": 1.0}, progress=False)
    out = sl.save(loaded, report, tmp_path / "m")
    assert isinstance(report["sparsity"]["mlp_width"]["pruned"], list)
    with pytest.raises(Exception, match="(?i)size|shape|mismatch"):
        AutoModelForCausalLM.from_pretrained(out)
    reloaded = sl.load(str(out), device="cpu").model  # spap's loader re-applies the recorded widths
    with torch.no_grad():
        torch.testing.assert_close(reloaded(windows).logits, loaded.model(windows).logits, rtol=1e-5, atol=1e-5)


def _layer_problem(loaded, windows, index=1):
    hidden, kwargs = first_layer_inputs(loaded.model, loaded.adapter.layers(), windows, 4, "cpu")
    for i, layer in enumerate(loaded.adapter.layers()[:index + 1]):
        hidden_next, X = replay(layer, hidden, {b: kw[i] for b, kw in kwargs.items()}, 4,
                                watch=loaded.adapter.mlp_input_module(layer))
        hidden = hidden_next
    return LayerProblem(dense=loaded.adapter.get_mlp(layer), X=X.float(), n_remove=20, layer_index=index)


def test_flap_bias_compensation_keeps_the_mean_output(windows):
    """FLAP adds the removed channels' mean contribution, so the pruned MLP's mean output over the
    calibration tokens equals the dense one (and Llama checkpoints carry it via mlp_bias)."""
    from conftest import tiny_model

    from spap_lib.model.loading import Loaded
    from spap_lib.model.sources import ModelSource

    model = tiny_model("llama")
    loaded = Loaded(model, None, sl.get_adapter(model), ModelSource("t", "dir", "-"), torch.device("cpu"))
    problem = _layer_problem(loaded, windows)
    flap = sl.get_method("flap", allocation="uniform")
    pruned = flap.prune(problem).mlp
    dense_mean, pruned_mean = problem.dense(problem.X).mean(0), pruned(problem.X).mean(0)
    torch.testing.assert_close(pruned_mean, dense_mean, rtol=1e-4, atol=1e-4)
    plain = sl.get_method("flap", allocation="uniform", bias=False).prune(problem).mlp
    assert (plain(problem.X).mean(0) - dense_mean).abs().max() > 10 * (pruned_mean - dense_mean).abs().max()


@pytest.mark.parametrize("arch_name", ["gemma3", "qwen2"])
def test_flap_refuses_models_without_a_bias_slot_before_any_work(arch_name, windows, monkeypatch):
    from conftest import tiny_model

    from spap_lib.model.loading import Loaded
    from spap_lib.model.sources import ModelSource
    from spap_lib.pipeline import sequential as pipeline

    model = tiny_model(arch_name)
    loaded = Loaded(model, None, sl.get_adapter(model), ModelSource("t", "dir", "-"), torch.device("cpu"))
    monkeypatch.setattr(pipeline, "first_layer_inputs", lambda *a, **k: pytest.fail("work started"))
    with pytest.raises(ValueError, match="no slot for one in stock transformers.*'bias': False"):
        sl.prune(loaded, calibration(windows), "flap", 0.3, progress=False)


def test_scores_match_their_formulas(loaded, windows):
    problem = _layer_problem(loaded, windows)
    mlp, X = problem.dense, problem.X
    Z = mlp.hidden(X).double()
    stats = ChannelStats.of(mlp, X)
    torch.testing.assert_close(stats.norm, Z.norm(dim=0))
    torch.testing.assert_close(stats.var, Z.var(dim=0))
    W = mlp.W_out.double()
    torch.testing.assert_close(sl.get_method("wanda_sp").score(mlp, stats), W.abs().sum(0) * Z.norm(dim=0))
    torch.testing.assert_close(sl.get_method("flap").score(mlp, stats), Z.var(dim=0) * W.pow(2).sum(0))
    torch.testing.assert_close(sl.get_method("magnitude").score(mlp, stats), W.norm(dim=0))
    # CFSP's per-channel-normalised terms average to 1/d each: the ranking is that of ‖Z_j‖.
    cfsp = sl.get_method("cfsp").score(mlp, stats)
    torch.testing.assert_close(cfsp, (len(mlp.W_in) + 1) / W.shape[0] * Z.norm(dim=0))


def test_fasp_refit_is_least_squares_on_the_kept_channels(loaded, windows):
    problem = _layer_problem(loaded, windows)
    result = sl.get_method("fasp", damp=0.0).prune(problem)
    Z = problem.dense.hidden(problem.X)[:, result.keep].double()
    if problem.has_bias:
        Z = torch.cat([Z, torch.ones(len(Z), 1, dtype=Z.dtype)], 1)
    W_ls = torch.linalg.lstsq(Z, problem.Y.double()).solution.T
    got = torch.cat([result.mlp.W_out, result.mlp.b_out[:, None]], 1) if problem.has_bias else result.mlp.W_out
    torch.testing.assert_close(got.double(), W_ls, rtol=1e-3, atol=1e-3)
    xnorm = problem.dense.hidden(problem.X).norm(dim=0)
    score = problem.dense.W_out.abs().sum(0) * xnorm
    assert set(result.keep.tolist()) == set(torch.topk(score, 64 - 20).indices.tolist())


@pytest.mark.parametrize("select", ["act_norm", "penalty"])
def test_an_anchored_refit_lies_between_the_dense_weights_and_least_squares(loaded, windows, select):
    """``anchor`` moves the refit from least squares (0) toward the kept channels' dense weights (update none):
    its calibration error lies between theirs and grows with the anchor, on the same kept channels."""
    problem = _layer_problem(loaded, windows)
    runs = {a: sl.get_method("spap", select=select, update="ls", K=5, anchor=a).prune(problem) for a in (0, 0.1, 10)}
    dense = sl.get_method("spap", select=select, update="none", K=5).prune(problem)
    assert all(torch.equal(r.keep, dense.keep) for r in runs.values())
    error = {a: calibration_error(r.mlp, problem.X, problem.Y, 64) for a, r in runs.items()}
    assert error[0] < error[0.1] < error[10] < calibration_error(dense.mlp, problem.X, problem.Y, 64)
    moved = {a: float((r.mlp.W_out - dense.mlp.W_out).norm()) for a, r in runs.items()}
    assert moved[0] > moved[0.1] > moved[10]
    assert "anchor" not in sl.get_method("spap", update="none", anchor=1.0).effective_hparams()


@pytest.mark.parametrize("update", ["ls", "alternating"])
def test_a_layer_whose_output_energy_sits_in_a_few_tokens_keeps_its_dense_weights(loaded, windows, update,
                                                                                  monkeypatch):
    """``concentrated``: where the largest 1% of tokens hold more of ‖Y‖² than it allows, the kept channels keep their
    dense weights, with no refit solved; elsewhere the update runs as without it. The share is measured, not
    assumed."""
    problem = _layer_problem(loaded, windows)
    X = problem.X.clone()
    X[::100] *= 50  # one token in a hundred with massive inputs, as at the first positions of Qwen2.5's windows
    massive = LayerProblem(dense=problem.dense, X=X, n_remove=20, layer_index=1)
    assert problem.concentration < 0.2 < massive.concentration
    hp = dict(select="act_norm", update=update, am_iters=2, adam_steps=2, batch_tokens=64)
    for p, fits in ((problem, True), (massive, False)):
        fresh = LayerProblem(dense=p.dense, X=p.X, n_remove=20, layer_index=1)
        plain = sl.get_method("spap", **hp).prune(fresh)
        refits = []
        spy = SPAP.refit
        monkeypatch.setattr(SPAP, "refit", lambda self, *a: refits.append(1) or spy(self, *a))
        guarded = sl.get_method("spap", concentrated=0.2, **hp).prune(
            LayerProblem(dense=p.dense, X=p.X, n_remove=20, layer_index=1))
        monkeypatch.undo()
        assert len(refits) == int(fits)
        dense = p.dense.select(guarded.keep)
        assert torch.equal(guarded.keep, plain.keep) and guarded.info["concentration"] == pytest.approx(p.concentration)
        assert torch.equal(guarded.mlp.W_out, plain.mlp.W_out if fits else dense.W_out)
        assert torch.equal(guarded.mlp.W_in[0], plain.mlp.W_in[0] if fits else dense.W_in[0])
    assert "concentrated" not in sl.get_method("spap", update="none", concentrated=0.5).effective_hparams()


@pytest.mark.parametrize("update, margin", [({"update_precision": "full"}, 0.9), ({}, 0.95)], ids=["paper", "bf16"])
@pytest.mark.parametrize("index", [0, 2])
def test_spap_fits_better_than_its_channels_dense_and_than_fasp(loaded, windows, index, update, margin):
    """On a layer's calibration tokens, SPAP's pruned MLP has a lower error than the same kept channels
    with their dense weights (the fit does something) and than FASP's (score + least-squares refit), and
    the errors it reports are the real ones. Measured margins on these tiny models: SPAP's error is
    0.1-0.25x the dense selection's and 0.66-0.85x FASP's with the paper's update (0.66-0.90x with
    bf16 rounds); the bounds below leave room for that spread."""
    problem = _layer_problem(loaded, windows, index)
    spap = sl.get_method("spap", K=5, am_iters=3, adam_steps=5, batch_tokens=64, **update).prune(problem)
    fasp = sl.get_method("fasp").prune(problem)
    error = {name: calibration_error(mlp, problem.X, problem.Y, 64) for name, mlp in
             (("spap", spap.mlp), ("fasp", fasp.mlp), ("selected", problem.dense.select(spap.keep)))}
    assert error["spap"] < 0.5 * error["selected"]
    assert error["spap"] < margin * error["fasp"]
    YY = float(problem.Y.double().pow(2).sum())
    assert spap.info["rel_error_final"] == pytest.approx(error["spap"] / YY, rel=1e-4)  # Gram vs direct sums
    assert spap.info["rel_error_final"] < margin * spap.info["rel_error_penalty"]  # the §3.3 update helped


def test_spap_ablations_share_the_penalty_stage(loaded, windows):
    problem = _layer_problem(loaded, windows)
    base = sl.get_method("spap", K=5, am_iters=0).prune(problem)
    no_update = sl.get_method("spap_no_update", K=5).prune(problem)
    assert torch.equal(base.keep, no_update.keep)
    torch.testing.assert_close(base.mlp.W_out, no_update.mlp.W_out)
    gd = sl.get_method("spap_gd", K=5, am_iters=3, adam_steps=5, batch_tokens=64).prune(problem)
    assert torch.equal(gd.keep, base.keep)
    # the reported errors are the real ones, and gradient descent moved every projection to a lower one
    YY = float(problem.Y.double().pow(2).sum())
    start, final = (calibration_error(m, problem.X, problem.Y, 64) / YY for m in (base.mlp, gd.mlp))
    assert gd.info["rel_error_penalty"] == pytest.approx(start, rel=1e-6)
    assert gd.info["rel_error_final"] == pytest.approx(final, rel=1e-6)
    assert gd.info["rel_error_final"] < 0.99 * gd.info["rel_error_penalty"]
    assert not torch.equal(gd.mlp.W_in[0], base.mlp.W_in[0]) and not torch.equal(gd.mlp.W_out, base.mlp.W_out)
    # least squares only: the preset carries no round settings at all (it has none to act)
    assert "am_iters" not in sl.get_method("spap_no_update").hparams()
    with pytest.raises(sl.ParameterError, match="am_iters"):
        sl.get_method("spap_no_update", am_iters=3)


def test_allocations_spend_exactly_the_budget():
    gen = torch.Generator().manual_seed(0)
    scores = [torch.rand(50, generator=gen) * (i + 1) for i in range(6)]
    counts = allocation.global_standardized(scores, 180)
    assert sum(counts) == 180 and all(c <= 49 for c in counts)
    assert allocation.global_standardized(scores, 6 * 49) == [49] * 6  # everything but one per layer
    imp = [100.0, 5000.0, 9000.0, 12000.0, 20000.0, 30000.0]
    counts = allocation.angular(imp, 50, 120, scale=1e4)
    assert sum(counts) == 120 and all(0 <= c <= 49 for c in counts)
    assert counts == sorted(counts, reverse=True)  # the block that changes the state least loses most
    assert allocation.angular([1.0] * 6, 50, 120) == [20] * 6  # equal importance: uniform


def test_rounded_widths_are_multiples_with_the_same_total_and_never_empty():
    for step in (2, 8, 16):
        counts = [0, 13, 49, 30, 7, 21]  # removals from width 50, one layer down to a single channel
        counts[0] += sum(50 - c for c in counts) % step  # the plan makes the total kept a multiple
        got = allocation.rounded(counts, 50, step)
        assert sum(got) == sum(counts) and all((50 - g) % step == 0 and step <= 50 - g <= 50 for g in got)
        assert got[2] == 50 - step  # the single channel rounds up to one multiple, never down to none
    assert allocation.rounded([0, 13, 49, 30], 64, 1) == [0, 13, 49, 30]  # a multiple of 1: unchanged
    with pytest.raises(ValueError, match="cannot be split into multiples of 8"):
        allocation.rounded([0, 13, 49, 30], 64, 8)  # 164 kept: not a multiple of 8


def test_score_method_paths_agree(arch, windows):
    """The dense-statistics path (grid) and the per-layer path give the same channels (uniform)."""
    from conftest import tiny_model

    from spap_lib.model.loading import Loaded
    from spap_lib.model.sources import ModelSource

    def fresh():
        model = tiny_model(arch)
        return Loaded(model, None, sl.get_adapter(model), ModelSource("t", "dir", "-"), torch.device("cpu"))

    calib = calibration(windows)
    a = sl.prune(fresh(), calib, "wanda_sp", 0.3, propagate=True, progress=False)  # per-layer path
    b_loaded = fresh()
    inputs = first_layer_inputs(b_loaded.model, b_loaded.adapter.layers(), windows, 1, "cpu")
    stats = dense_stats(b_loaded.adapter, inputs, run=QUIET)
    b = sl.prune(b_loaded, calib, "wanda_sp", 0.3, progress=False, inputs=inputs, stats=stats)
    assert a["propagate"] and not b["propagate"]
    assert a["kept_channels"][0] == b["kept_channels"][0]  # layer 0 sees the same inputs on both paths


def test_unknown_method_or_allocation_is_explained():
    with pytest.raises(ValueError, match="registered methods are .*cfsp.*fasp.*flap.*magnitude.*spap.*wanda_sp"):
        sl.get_method("sparsegpt")
    with pytest.raises(ValueError, match="supports allocation uniform or global"):
        sl.get_method("wanda_sp", allocation="angular")
    from spap_lib.artifact.grid import Variant

    with pytest.raises(ValueError, match="unknown hyperparameter"):
        Variant.parse("flap/threshold=3")
    assert Variant.parse("flap/allocation=uniform,bias=false").hparams == {"allocation": "uniform", "bias": False}
    # YAML 1.1 reads "1e-4" (no dot) and "1.5e3" (unsigned exponent) as text: a label means the number; a
    # config value gets told how to write it so that YAML reads a float
    import yaml

    assert Variant.parse("spap/lr=1e-4,am_iters=3,damp=1.5e3").hparams == {"lr": 1e-4, "am_iters": 3, "damp": 1500.0}
    for text, fix in (("1e-4", "1.0e-4"), ("1.5e3", "1.5e+3"), ("2E-3", "2.0e-3")):
        with pytest.raises(ValueError, match=f"write {re.escape(fix)}"):
            sl.get_method("spap", lr=text)
        assert yaml.safe_load(fix) == float(text)


@pytest.mark.parametrize("choice", ["global", "angular"])
def test_spap_with_allocation_across_layers(choice, windows, tiny_tokenizer, tmp_path):
    """SPAP can take non-uniform budgets (decided on dense statistics) and still spend exactly the plan."""
    from conftest import tiny_model

    from spap_lib.model.loading import Loaded
    from spap_lib.model.sources import ModelSource

    model = tiny_model("llama")
    loaded = Loaded(model, tiny_tokenizer, sl.get_adapter(model), ModelSource("t", "dir", "-"), torch.device("cpu"))
    plan = sl.plan_sparsity(loaded.adapter, 0.3)
    report = sl.prune(loaded, calibration(windows), "spap", 0.3, hparams={**FAST, "allocation": choice}, progress=False)
    removed = [layer["removed"] for layer in report["layers"]]
    assert sum(removed) == plan.n_remove * 3 and report["propagate"]
    out = sl.save(loaded, report, tmp_path / "m")
    with torch.no_grad():
        torch.testing.assert_close(sl.load(str(out), device="cpu").model(windows).logits,
                                   loaded.model(windows).logits, rtol=1e-5, atol=1e-5)


def test_the_angular_allocation_of_a_propagating_prune_replays_the_dense_layers_only(windows, tiny_tokenizer,
                                                                                       monkeypatch):
    """Its widths read the blocks' angular distances alone: the dense pass keeps no MLP inputs and measures no
    channel (the allocation's ``needs``), and the widths are those of a pass that measures everything."""
    from conftest import tiny_model

    from spap_lib.model.loading import Loaded
    from spap_lib.model.sources import ModelSource
    from spap_lib.numerics import stats

    model = tiny_model("llama")
    loaded = Loaded(model, tiny_tokenizer, sl.get_adapter(model), ModelSource("t", "dir", "-"), torch.device("cpu"))
    inputs = first_layer_inputs(loaded.model, loaded.adapter.layers(), windows, 1, torch.device("cpu"))
    full = dense_stats(loaded.adapter, inputs, run=QUIET)
    measured = []
    real = stats.ChannelStats.of
    monkeypatch.setattr(stats.ChannelStats, "of", classmethod(lambda cls, *a, **k: measured.append(1) or real(*a, **k)))
    method = sl.get_method("spap", **FAST, allocation="angular")
    assert not method.dense_pass(propagate=True).channels
    blocks = dense_stats(loaded.adapter, inputs, run=QUIET, channels=False)
    assert not measured and [s.angular for s in blocks] == [s.angular for s in full]
    plan = sl.plan_sparsity(loaded.adapter, 0.3)
    total = plan.n_remove * len(full)
    assert method.removals(blocks, plan.width, total) == method.removals(full, plan.width, total)
    with pytest.raises(AttributeError):
        blocks[0].norm  # noqa: B018 -- no channel statistics were measured, and reading them says so
    report = sl.prune(loaded, calibration(windows), "spap", 0.3, hparams={**FAST, "allocation": "angular"},
                      progress=False)
    assert not measured and [layer["removed"] for layer in report["layers"]] == \
        method.removals(full, plan.width, total)


@pytest.mark.parametrize("allocation", ["angular", "error"])
def test_an_allocation_sample_decides_the_widths_on_the_first_windows_alone(windows, tiny_tokenizer, monkeypatch,
                                                                           allocation):
    """``allocation_sample=0.5``: the dense pass that decides the widths reads the first half of the windows, and
    the widths are those of a pass over those windows; the prune itself reads every window."""
    from conftest import tiny_model

    from spap_lib.model.loading import Loaded
    from spap_lib.model.sources import ModelSource
    from spap_lib.pipeline import sequential as pipeline

    model = tiny_model("llama")
    loaded = Loaded(model, tiny_tokenizer, sl.get_adapter(model), ModelSource("t", "dir", "-"), torch.device("cpu"))
    half = windows.shape[0] // 2
    hparams = {**FAST, "allocation": allocation, "allocation_sample": 0.5}
    method = sl.get_method("spap", **hparams)
    first = first_layer_inputs(loaded.model, loaded.adapter.layers(), windows[:half], 1, torch.device("cpu"))
    curve = method.error_curve if allocation == "error" else None
    expected_stats = dense_stats(loaded.adapter, first, run=QUIET, curve=curve,
                                 channels=method.dense_pass(True).channels)
    plan = sl.plan_sparsity(loaded.adapter, 0.3)
    expected = method.removals(expected_stats, plan.width, plan.n_remove * len(expected_stats))
    read, real = [], pipeline.dense_stats
    monkeypatch.setattr(pipeline, "dense_stats", lambda adapter, inputs, **k: read.append(inputs[0].shape[0]) or
                        real(adapter, inputs, **k))
    report = sl.prune(loaded, calibration(windows), "spap", 0.3, hparams=hparams, progress=False)
    assert read == [half]
    assert [layer["removed"] for layer in report["layers"]] == expected
    assert sum(expected) == plan.n_remove * len(expected_stats)
    assert "allocation_sample" not in sl.get_method("spap", allocation_sample=0.5).effective_hparams()  # uniform


def test_a_new_allocation_is_one_registered_entry_that_spap_composes_with(windows, tiny_tokenizer, monkeypatch):
    """Registering an allocation makes it a valid ``allocation`` of SPAP at once; the pipeline takes the dense
    pass its ``needs`` declare (here the blocks' angular distances alone) and the widths its ``split`` gives."""
    from conftest import tiny_model

    from spap_lib.methods.parts.allocation import ALLOCATIONS, Allocation
    from spap_lib.model.loading import Loaded
    from spap_lib.model.sources import ModelSource
    from spap_lib.pipeline import sequential as pipeline

    def last_layers_first(method, stats, width, total, scores):
        counts = [0] * len(stats)
        for i in reversed(range(len(stats))):
            counts[i] = min(width - 1, total - sum(counts))
        return counts

    monkeypatch.setitem(ALLOCATIONS, "last_first", Allocation("last_first", frozenset({"dense_pass"}),
                                                              split=last_layers_first))
    model = tiny_model("llama")
    loaded = Loaded(model, tiny_tokenizer, sl.get_adapter(model), ModelSource("t", "dir", "-"), torch.device("cpu"))
    taken, real = [], pipeline.dense_stats
    monkeypatch.setattr(pipeline, "dense_stats", lambda adapter, inputs, **k: taken.append(k["channels"]) or
                        real(adapter, inputs, **k))
    method = sl.get_method("spap", **FAST, allocation="last_first")
    assert not method.uniform_widths and not method.dense_pass(True).channels
    plan = sl.plan_sparsity(loaded.adapter, 0.3)
    report = sl.prune(loaded, calibration(windows), "spap", 0.3, hparams={**FAST, "allocation": "last_first"},
                      progress=False)
    layers = len(report["layers"])
    assert taken == [False]
    assert [layer["removed"] for layer in report["layers"]] == \
        last_layers_first(method, [None] * layers, plan.width, plan.n_remove * layers, None)
    with pytest.raises(sl.ParameterError, match="supports allocation"):
        sl.get_method("cfsp", allocation="last_first")  # a baseline offers the allocations it declares


def test_an_allocation_precision_of_bf16_replays_the_dense_layers_with_bf16_products(windows, tiny_tokenizer,
                                                                                     monkeypatch):
    """``allocation_precision="bf16"``: the dense pass that decides the widths replays every layer with bf16
    products (``torch.autocast``), its angular distances are those of such a replay (not the float32 ones), and
    the prune's widths are the ones they give; a score method's own statistics stay at the model's precision."""
    from conftest import tiny_model

    from spap_lib.model.loading import Loaded
    from spap_lib.model.sources import ModelSource
    from spap_lib.numerics.stats import block_angular
    from spap_lib.pipeline import sequential as pipeline

    model = tiny_model("llama")
    loaded = Loaded(model, tiny_tokenizer, sl.get_adapter(model), ModelSource("t", "dir", "-"), torch.device("cpu"))
    layers = loaded.adapter.layers()
    inputs = first_layer_inputs(loaded.model, layers, windows, 1, torch.device("cpu"))
    expected, hidden = [], inputs[0]
    for i, layer in enumerate(layers):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = replay(layer, hidden, {b: kw[i] for b, kw in inputs[1].items()}, 1)[0]
        expected.append(block_angular(hidden, out))
        hidden = out
    low = dense_stats(loaded.adapter, inputs, run=QUIET, channels=False, in_bf16=True)
    full = dense_stats(loaded.adapter, inputs, run=QUIET, channels=False)
    assert [s.angular for s in low] == pytest.approx(expected, rel=1e-6)
    assert max(abs(a.angular - b.angular) / b.angular for a, b in zip(low, full)) > 1e-4  # bf16, not float32
    hparams = {**FAST, "allocation": "angular", "allocation_precision": "bf16"}
    method = sl.get_method("spap", **hparams)
    dense = method.dense_pass(propagate=True)
    assert (dense.share, dense.bf16, dense.scores) == (1.0, True, False)
    dense = sl.get_method("cfsp").dense_pass(propagate=False)  # a score method's own statistics: every window
    assert (dense.share, dense.bf16, dense.scores, dense.channels) == (1.0, False, True, True)
    plan = sl.plan_sparsity(loaded.adapter, 0.3)
    taken, real = [], pipeline.dense_stats
    monkeypatch.setattr(pipeline, "dense_stats", lambda adapter, inputs, **k: taken.append(k["in_bf16"]) or
                        real(adapter, inputs, **k))
    report = sl.prune(loaded, calibration(windows), "spap", 0.3, hparams=hparams, progress=False)
    assert taken == [True]
    assert [layer["removed"] for layer in report["layers"]] == method.removals(low, plan.width,
                                                                               plan.n_remove * len(layers))
    assert "allocation_precision" not in sl.get_method("spap", allocation_precision="bf16").effective_hparams()
    with pytest.raises(sl.ParameterError, match="full"):
        sl.get_method("spap", allocation_precision="fp16")


def test_a_new_method_file_is_registered_and_drawn_without_editing_anything(tmp_path):
    """Auto-registration: a module dropped into spap_lib/methods/ is imported by the package, its
    method is in the registry, and figures order it from what the class declares."""
    import importlib
    import sys

    import spap_lib.methods as methods_pkg
    from spap_lib.artifact.figures import method_order

    path = Path(methods_pkg.__file__).parent / "zz_test_only_method.py"
    path.write_text(
        "from dataclasses import dataclass\n"
        "from .base import register\nfrom .scores import Magnitude\n\n"
        "@register\n@dataclass\nclass TestOnly(Magnitude):\n    name = 'test_only_method'\n")
    try:
        importlib.reload(methods_pkg)
        assert "test_only_method" in sl.METHODS
        order = method_order()
        assert order.index("test_only_method") < order.index("spap_no_update") < order.index("spap")
        assert order[-1] == "spap" and set(order) == set(sl.METHODS)
    finally:
        path.unlink()
        sl.METHODS.pop("test_only_method", None)
        sys.modules.pop("spap_lib.methods.zz_test_only_method", None)
