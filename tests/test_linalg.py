"""Closed-form steps equal direct solves; the penalty loop ends feasible; numerics fail loudly."""
import pytest
import torch

import spap_lib as sl
from spap_lib.methods.spap import alternating
from spap_lib.methods.spap.alternating import Rounds, adam, alternating_update
from spap_lib.methods.spap.penalty import Penalty, penalty_method
from spap_lib.model.adapters import MLP
from spap_lib.numerics import linalg, solve
from spap_lib.numerics.collective import subsample
from spap_lib.numerics.linalg import NumericalError, gram
from spap_lib.numerics.solve import lstsq_columns, nested_lstsq_errors, reconstruction_error, ridge


def _penalty(W0, H, lam, *, bias, **settings):
    return penalty_method(W0, H, lam, Penalty(**settings), bias=bias)


def _data(n=12, d=5, N=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    Z = torch.randn(n, N, generator=g, dtype=torch.float64) * torch.linspace(0.2, 3, n, dtype=torch.float64)[:, None]
    Y = torch.randn(d, N, generator=g, dtype=torch.float64)
    return Z, Y


def test_ridge_step_equals_direct_least_squares():
    Z, Y = _data()
    penalty = torch.rand(Z.shape[0], dtype=torch.float64) * 50
    W = ridge(Y @ Z.T, Z @ Z.T, penalty)
    # ridge == ordinary least squares on the system augmented with sqrt(penalty) rows
    A = torch.cat([Z.T, torch.diag(penalty.sqrt())])
    B = torch.cat([Y.T, torch.zeros(Z.shape[0], Y.shape[0], dtype=torch.float64)])
    W_direct = torch.linalg.lstsq(A, B).solution.T
    torch.testing.assert_close(W, W_direct, rtol=1e-9, atol=1e-9)


def test_column_refit_equals_least_squares_on_kept_rows():
    Z, Y = _data()
    cols = torch.tensor([0, 3, 4, 9])
    W = lstsq_columns(Y @ Z.T, Z @ Z.T, cols, delta=0.0)
    W_direct = torch.linalg.lstsq(Z[cols].T, Y.T).solution.T
    torch.testing.assert_close(W, W_direct, rtol=1e-8, atol=1e-8)


def test_anchored_refit_is_least_squares_with_rows_pulling_toward_the_dense_weights():
    Z, Y = _data()
    cols, pull = torch.tensor([0, 3, 4, 9]), 7.0
    W0 = torch.randn(Y.shape[0], Z.shape[0], dtype=torch.float64)
    W = lstsq_columns(Y @ Z.T, Z @ Z.T, cols, delta=0.0, toward=W0, pull=pull)
    # min ‖Y − W Z_K‖² + pull‖W − W₀_K‖²: least squares on Z_K stacked with sqrt(pull)·I against sqrt(pull)·W₀_K
    A = torch.cat([Z[cols].T, pull ** 0.5 * torch.eye(len(cols), dtype=Z.dtype)])
    B = torch.cat([Y.T, pull ** 0.5 * W0[:, cols].T])
    torch.testing.assert_close(W, torch.linalg.lstsq(A, B).solution.T, rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("pull", [0.0, 7.0])
def test_nested_refit_errors_are_the_errors_of_one_refit_per_set(pull, dtype):
    Z, Y = _data(n=40, d=6, N=300)
    Z[7] = Z[3] * 2.0  # a column the others span: the damping keeps every system definite
    H, YZ, YY = (Z @ Z.T).to(dtype), (Y @ Z.T).to(dtype), float((Y ** 2).sum())
    W0 = torch.randn(Y.shape[0], Z.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    order, sizes, delta = torch.randperm(40, generator=torch.Generator().manual_seed(2)), [40, 31, 12, 5, 1], 1e-3
    nested = nested_lstsq_errors(YZ, H, order, sizes, delta, YY, toward=W0.to(dtype), pull=pull)
    # one refit per kept set, its error measured on the tokens themselves (float64 reference)
    for k, error in zip(sizes, nested):
        cols = torch.sort(order[:k]).values
        W = lstsq_columns(Y @ Z.T, Z @ Z.T, cols, delta, toward=W0, pull=pull)
        direct = float(((Y - W @ Z[cols]) ** 2).sum())
        assert error == pytest.approx(direct, rel=1e-9 if dtype == torch.float64 else 1e-5)
    if not pull:
        assert nested == sorted(nested)  # fewer kept columns, never a smaller least-squares error


def test_nested_refit_errors_refuse_an_indefinite_system():
    Z, Y = _data()
    H = Z @ Z.T
    H[0, 0] = -1.0
    with pytest.raises(NumericalError, match="error curve"):
        nested_lstsq_errors(Y @ Z.T, H, torch.arange(12), [12], 0.0, 1.0)


@pytest.mark.parametrize("threshold", ["top", "previous"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("lam", [1, 5, 11])
def test_penalty_method_returns_feasible_binary_mask(bias, lam, threshold):
    Z, Y = _data()
    Zt = torch.cat([Z, torch.ones(1, Z.shape[1], dtype=Z.dtype)]) if bias else Z
    W0 = torch.randn(Y.shape[0], Zt.shape[0], dtype=torch.float64)
    keep, W, info = _penalty(W0, Zt @ Zt.T, lam, bias=bias, rho0=1e-2, tau=1.5, t=0.5, alpha=0.5, K=20,
                                   damp=0.0, threshold=threshold)
    n = Z.shape[0]
    assert 0 <= info["moved"] <= lam
    assert keep.dtype == torch.long and len(keep) == n - lam
    assert torch.equal(keep, torch.unique(keep)) and 0 <= int(keep.min()) and int(keep.max()) < n
    assert W.shape == (Y.shape[0], n - lam + bias)
    # the refit is the exact least-squares fit of the dense outputs on the kept rows (+ ones row)
    cols = torch.cat([keep, keep.new_tensor([n])]) if bias else keep
    W_direct = torch.linalg.lstsq(Zt[cols].T, (W0 @ Zt).T).solution.T
    torch.testing.assert_close(W, W_direct, rtol=1e-7, atol=1e-7)


def test_one_penalty_iteration_removes_the_first_score_step():
    """K = 1: the hard mask is the first s-step's choice (``moved`` = 0) under either rule; more
    iterations with a strong penalty may move it, and ``moved`` counts exactly the difference."""
    from spap_lib.methods.parts.selection import column_scores

    Z, Y = _data()
    H = Z @ Z.T
    W0 = torch.randn(Y.shape[0], Z.shape[0], dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    first = set(torch.topk(column_scores(W0, torch.diagonal(H).sqrt(), 0.5), 5, largest=False).indices.tolist())
    for threshold in ("top", "previous"):
        keep, _, info = _penalty(W0, H, 5, bias=False, rho0=1e-2, tau=1.5, t=0.5, alpha=0.5, K=1, damp=0.0,
                                       threshold=threshold)
        assert info["moved"] == 0 and set(range(Z.shape[0])) - set(keep.tolist()) == first
    keep, _, info = _penalty(W0, H, 5, bias=False, rho0=10.0, tau=2.0, t=0.5, alpha=0.0, K=20, damp=0.0)
    assert info["moved"] == len((set(range(Z.shape[0])) - set(keep.tolist())) - first)


def test_patience_ends_the_penalty_loop_where_the_marked_set_settles():
    """``patience`` p: the loop stops after p unchanged s-steps (p + 1 iterations where the first set stays), and
    counts afresh when the set moves; here, as on the real layers measured, the kept channels and the refit are
    all K iterations' to the bit."""
    Z, _ = _data(seed=1)
    Z = Z + 0.9 * Z[torch.randperm(12, generator=torch.Generator().manual_seed(1))]  # correlated channels
    W0 = torch.randn(5, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(101))
    kw = dict(bias=False, rho0=1e-2, tau=1.5, t=1.0, alpha=0.5, K=20, damp=0.0)
    keep, W, info = _penalty(W0, Z @ Z.T, 5, **kw)
    assert info["iterations"] == 20 and info["moved"] == 1  # the set moves once, after the first s-step
    for p in (1, 2, 3):
        keep_p, W_p, info_p = _penalty(W0, Z @ Z.T, 5, **kw, patience=p)
        assert info_p["iterations"] == p + 2 and info_p["moved"] == 1  # one move: the count starts again
        assert torch.equal(keep_p, keep) and torch.equal(W_p, W)
    Z, _ = _data()
    _, _, info = _penalty(W0, Z @ Z.T, 5, **kw, patience=3)
    assert info["iterations"] == 4 and info["moved"] == 0  # a set that never moves: p + 1 iterations


@pytest.mark.parametrize("threshold", ["top", "previous"])
def test_penalty_method_finds_planted_support(threshold):
    """Outputs that depend on a subset of channels only (plus a bias): that subset is kept."""
    g = torch.Generator().manual_seed(3)
    n, lam = 16, 6
    Z = torch.randn(n, 400, generator=g, dtype=torch.float64)
    W0 = torch.randn(4, n + 1, generator=g, dtype=torch.float64)
    removed = torch.tensor([1, 2, 5, 8, 13, 15])
    W0[:, removed] = 0
    Zt = torch.cat([Z, torch.ones(1, 400, dtype=Z.dtype)])
    keep, W, _ = _penalty(W0, Zt @ Zt.T, lam, bias=True, rho0=1e-2, tau=1.5, t=0.5, alpha=0.5, K=20, damp=0.0,
                                threshold=threshold)
    assert set(keep.tolist()) == set(range(n)) - set(removed.tolist())
    torch.testing.assert_close(W, W0[:, torch.cat([keep, keep.new_tensor([n])])])


def _rounds(**settings) -> Rounds:
    """Four rounds of 20 Adam steps on these small problems, unless a test says otherwise."""
    return Rounds(**{"iters": 4, "adam_steps": 20, "lr": 1e-2, "batch_tokens": 512, "damp": 1e-6, "chunk": 700,
                     "seed": 0, **settings})


def _start(mlp, Y, H, YZ) -> dict:
    """``alternating_update``'s starting error (from the Gram statistics of ``mlp``'s start), ``‖Y‖²`` and precision."""
    from spap_lib.numerics.linalg import sq_norm

    YY = sq_norm(Y)
    return {"start_error": reconstruction_error(mlp.out_augmented(), H, YZ, YY) / YY, "YY": YY, "dtype": H.dtype}


def test_alternating_update_never_worse_and_improves():
    torch.manual_seed(0)
    d, n, N = 8, 24, 2000
    X = torch.randn(N, d)
    dense = MLP([torch.randn(n, d), torch.randn(n, d)], [None, None], torch.randn(d, n), None,
                torch.nn.functional.silu, glu=True)
    Y = dense(X)
    pruned = dense.select(torch.arange(0, n, 2))
    H, YZ = gram(pruned, X, 700, Y)
    out, errors = alternating_update(pruned, X, Y, _rounds(iters=5), **_start(pruned, Y, H, YZ))
    assert errors["final"] == min(errors["rounds"]) < 0.9 * errors["start"]
    err = float(((out(X) - Y) ** 2).sum() / (Y ** 2).sum())
    assert err == pytest.approx(errors["final"], rel=1e-3)


def _update_problem(N=3000, seed=0):
    torch.manual_seed(seed)
    d, n = 8, 24
    X = torch.randn(N, d)
    dense = MLP([torch.randn(n, d), torch.randn(n, d)], [None, None], torch.randn(d, n), None,
                torch.nn.functional.silu, glu=True)
    Y = dense(X)
    pruned = dense.select(torch.arange(0, n, 2))
    return pruned, X, Y


def test_cheap_rounds_refit_on_every_token_and_report_the_real_error(monkeypatch):
    """Rounds on a token sample in bf16: the best round is refitted once on all tokens at the method's
    precision (one more full Gram pass), and the error reported is that of the returned MLP on every token."""
    pruned, X, Y = _update_problem()
    H, YZ = gram(pruned, X, 700, Y)
    passes = []
    real_gram = alternating.gram
    monkeypatch.setattr(alternating, "gram", lambda m, X_, *a, **k: passes.append((len(X_), k.get("in_bf16"))) or
                        real_gram(m, X_, *a, **k))
    out, errors = alternating_update(pruned, X, Y, _rounds(sketch_tokens=1000, bf16=True), **_start(pruned, Y, H, YZ))
    assert passes == [(1000, True)] * 4 + [(3000, False)]
    err = float(((out(X) - Y).double() ** 2).sum() / (Y.double() ** 2).sum())
    assert err == pytest.approx(errors["final"], rel=1e-4)
    assert errors["final"] < 0.9 * errors["start"]
    # the paper's update (every token, full precision): no extra pass, the best round's own error
    passes.clear()
    _, exact = alternating_update(pruned, X, Y, _rounds(), **_start(pruned, Y, H, YZ))
    assert passes == [(3000, False)] * 4 and exact["final"] == min(exact["rounds"])


def test_the_final_refit_runs_after_adams_state_is_freed(monkeypatch):
    """Adam's moments and the last gradients are gone when the final refit passes over every token: on a GPU that
    pass and its solve were the prune's peak while they lived (a 6·d·k float32 saving)."""
    pruned, X, Y = _update_problem()
    H, YZ = gram(pruned, X, 700, Y)
    made, seen = [], []
    real_adam, real_gram = alternating.adam, alternating.gram
    monkeypatch.setattr(alternating, "adam", lambda *a: made.append(real_adam(*a)) or made[-1])
    monkeypatch.setattr(alternating, "gram", lambda m, X_, *a, **k: seen.append(
        (len(X_), len(made[0][1].state), any(p.grad is not None for p in made[0][0]))) or real_gram(m, X_, *a, **k))
    alternating_update(pruned, X, Y, _rounds(sketch_tokens=1000, bf16=True), **_start(pruned, Y, H, YZ))
    assert seen[:4] == [(1000, 2, True)] * 4  # the rounds: the moments of gate and up, their gradients
    assert seen[4:] == [(3000, 0, False)]  # the final refit on every token: both freed


@pytest.mark.parametrize("block", [8, 1024])
def test_reconstruction_error_in_float64_blocks_is_the_direct_error(monkeypatch, block):
    """``‖Y − W Z̃‖²`` from the Gram statistics, a block of W's rows and H's columns at a time (ragged last blocks
    too), equals the error computed from the tokens."""
    Z, Y = _data(n=25, d=37, N=400)
    W = ridge(Y @ Z.T, Z @ Z.T, torch.full((25,), 1e-3, dtype=torch.float64)).float()  # a fit, so the terms cancel
    monkeypatch.setattr(solve, "ERROR_BLOCK", block)
    error = solve.reconstruction_error(W, (Z @ Z.T).float(), (Y @ Z.T).float(), float((Y ** 2).sum()))
    assert error == pytest.approx(float(((Y - W.double() @ Z) ** 2).sum()), rel=1e-5)


def test_the_final_refit_in_bf16_takes_bf16_products_and_reports_its_real_error(monkeypatch):
    """``refit_precision="bf16"``: the best round's refit on every token takes the rounds' bf16 products (one
    pass, ``in_bf16``), its output projection is the least-squares fit on those statistics, close to the full
    refit's, and the error reported is the returned MLP's on every token. The option acts only where there is
    such a refit."""
    import spap_lib as sl
    pruned, X, Y = _update_problem()
    H, YZ = gram(pruned, X, 700, Y)
    passes, real_gram = [], alternating.gram
    monkeypatch.setattr(alternating, "gram", lambda m, X_, *a, **k: passes.append((len(X_), k.get("in_bf16"))) or
                        real_gram(m, X_, *a, **k))
    run = dict(sketch_tokens=1000, bf16=True)
    full, full_errors = alternating_update(pruned.clone("cpu"), X, Y, _rounds(**run), **_start(pruned, Y, H, YZ))
    passes.clear()
    out, errors = alternating_update(pruned.clone("cpu"), X, Y, _rounds(**run, refit_bf16=True),
                                     **_start(pruned, Y, H, YZ))
    assert passes == [(1000, True)] * 4 + [(3000, True)]
    assert torch.equal(out.W_in[0], full.W_in[0])  # the same rounds, only the last refit differs
    assert not torch.equal(out.W_out, full.W_out)
    assert float((out.W_out - full.W_out).norm() / full.W_out.norm()) < 1e-2
    err = float(((out(X) - Y).double() ** 2).sum() / (Y.double() ** 2).sum())
    assert err == pytest.approx(errors["final"], rel=1e-2)
    assert errors["final"] == pytest.approx(full_errors["final"], rel=1e-2)
    assert "refit_precision" in sl.get_method("spap").effective_hparams()
    for inert in ({"sketch_tokens": 0, "update_precision": "full"}, {"update": "gd"}, {"am_iters": 0}):
        assert "refit_precision" not in sl.get_method("spap", **inert).effective_hparams()


def test_cheap_rounds_never_return_a_worse_layer():
    """An update that diverges (a huge Adam rate) on a sample still returns the start, whose error it reports."""
    pruned, X, Y = _update_problem()
    H, YZ = gram(pruned, X, 700, Y)
    start = pruned.clone()  # the update trains ``pruned`` in place
    rounds = _rounds(iters=2, adam_steps=5, lr=50.0, sketch_tokens=500, bf16=True)
    out, errors = alternating_update(pruned, X, Y, rounds, **_start(pruned, Y, H, YZ))
    assert errors["final"] == errors["start"]
    assert torch.equal(out.W_in[0], start.W_in[0]) and torch.equal(out.W_out, start.W_out)


def test_subsample_is_a_fixed_sorted_sample_and_zero_means_every_token():

    X, Y = torch.arange(100.0)[:, None], torch.arange(100.0)[:, None] * 2
    Xs, Ys = subsample(X, Y, 30, seed=3)
    assert len(Xs) == 30 and torch.equal(Ys, 2 * Xs) and bool((Xs[1:] > Xs[:-1]).all())
    assert torch.equal(subsample(X, Y, 30, seed=3)[0], Xs) and not torch.equal(subsample(X, Y, 30, seed=4)[0], Xs)
    assert subsample(X, Y, 0, 3)[0] is X and subsample(X, Y, 100, 3)[0] is X


def test_low_precision_gram_stays_positive_definite_and_close():
    """bf16 products for Z and Y Zᵀ; Z Zᵀ in float32 of the rounded Z, so a damped Cholesky never fails."""
    pruned, X, Y = _update_problem()
    H, YZ = gram(pruned, X, 700, Y)
    Hl, YZl = gram(pruned, X, 700, Y, in_bf16=True)
    torch.testing.assert_close(Hl, Hl.T)
    assert float(torch.linalg.eigvalsh(Hl).min()) > -1e-9 * float(Hl.diagonal().max())
    assert float((Hl - H).norm() / H.norm()) < 1e-2 and float((YZl - YZ).norm() / YZ.norm()) < 1e-2


def test_dense_pass_with_targets_equals_the_two_passes():
    """``LayerProblem(targets=True)`` computes H and Y in one pass, bit for bit as computed apart."""
    from spap_lib.methods import LayerProblem

    pruned, X, _ = _update_problem()
    one, two = LayerProblem(pruned, X, 3, chunk=700, targets=True), LayerProblem(pruned, X, 3, chunk=700)
    assert torch.equal(one.H, two.H) and torch.equal(one.Y, two.Y)
    first_y = LayerProblem(pruned, X, 3, chunk=700, targets=True)
    assert torch.equal(first_y.Y, two.Y) and torch.equal(first_y.H, two.H)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_targets_wait_in_the_inputs_dtype_as_the_float32_output_rounded(dtype):
    """The targets ``Y`` take ``X``'s dtype and place (host memory when offloaded): each chunk's float32 output
    rounded once, the same numbers from the Gram pass and from the outputs alone."""
    pruned, X, _ = _update_problem()
    X = X.to(dtype)
    H, Y = linalg.gram_and_outputs(pruned, X, chunk=X.shape[0])
    assert Y.dtype == dtype and torch.equal(Y, pruned(X.float()).to(dtype))
    assert torch.equal(Y, linalg.outputs(pruned, X, chunk=X.shape[0]))
    assert torch.equal(linalg.outputs(pruned, X, chunk=700), linalg.gram_and_outputs(pruned, X, chunk=700)[1])


def test_passes_without_gradients_compute_the_same_activations_in_less_memory():
    """``MLP.hidden`` without gradients multiplies the up projection in place: bit for bit the product autograd
    sees, in bf16 products too."""
    pruned, X, _ = _update_problem()
    with torch.no_grad():
        lean = pruned.hidden(X)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lean_bf16 = pruned.hidden(X)
    W = pruned.W_in[0].clone().requires_grad_()
    graded = MLP([W, pruned.W_in[1]], pruned.b_in, pruned.W_out, None, pruned.act, glu=True)
    assert torch.equal(lean, graded.hidden(X).detach())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(lean_bf16, graded.hidden(X).detach())


def test_wide_layers_pass_in_chunks_whose_activations_fit_a_fixed_budget(monkeypatch):
    from spap_lib.methods import LayerProblem
    from spap_lib.numerics import linalg
    from spap_lib.numerics.linalg import CHUNK_BYTES, chunk_for

    assert [chunk_for(n, 8192) for n in (1536, 4864)] == [8192, 8192]  # the offline models: unchanged
    for n in (8960, 14336, 28672):  # Qwen2.5-1.5B, LLaMA-3-8B, 70B
        assert chunk_for(n, 8192) < 8192 and 2 * n * 4 * chunk_for(n, 8192) <= CHUNK_BYTES
    assert chunk_for(28672, 100) == 100 and chunk_for(10**12, 8192) == 1
    pruned, X, _ = _update_problem()
    method = sl.get_method("fasp")
    assert LayerProblem.of(method, pruned, X, 3, chunk=700).chunk == 700
    # a budget of 100 tokens at this width: the same Gram matrix to float32 rounding, in smaller chunks
    monkeypatch.setattr(linalg, "CHUNK_BYTES", 100 * 2 * pruned.width * 4)
    small = LayerProblem.of(method, pruned, X, 3, chunk=700)
    assert small.chunk == 100
    torch.testing.assert_close(small.H, LayerProblem(pruned, X, 3, chunk=700, dtype=small.dtype).H, rtol=1e-4, atol=0)


@pytest.mark.parametrize("lr_scale", ["rms", "absolute"])
def test_adam_step_is_lr_times_each_tensors_rms(lr_scale):
    """Adam's first step moves every element by lr (its update is lr·sign(g) then): with lr_scale="rms"
    that is lr × the tensor's RMS, so one setting fits models whose weights differ 10× in scale
    (SmolLM2 ≈ 0.19, Qwen2.5-0.5B 0.004–0.06); a zero bias steps like its weight."""

    torch.manual_seed(0)
    W_gate, W_up, b = 0.01 * torch.randn(16, 8), 3.0 * torch.randn(16, 8), torch.zeros(16)
    weights = [W_gate.clone().requires_grad_(), W_up.clone().requires_grad_()]
    params, opt = adam(weights, [None, b.clone().requires_grad_()], 1e-2, lr_scale)  # the bias is added after W_up
    assert len(params) == 3 and all(p is W for p, W in zip(params, weights))
    sum((p * torch.randn_like(p)).sum() for p in params).backward()
    opt.step()
    rms = [float(W_gate.pow(2).mean().sqrt()), float(W_up.pow(2).mean().sqrt())]
    expected = [1e-2 * r for r in (rms[0], rms[1], rms[1])] if lr_scale == "rms" else [1e-2] * 3
    for p, start, step in zip(params, [W_gate, W_up, b], expected):
        torch.testing.assert_close((p.detach() - start).abs(), torch.full_like(start, step), rtol=1e-3, atol=0)


def test_nan_and_singular_gram_raise_clear_errors():
    from spap_lib.numerics.linalg import check_finite
    from spap_lib.numerics.solve import solve_spd

    H = torch.eye(3)
    H[0, 0] = float("nan")
    with pytest.raises(NumericalError, match="NaN"):
        check_finite(H, "Gram")
    with pytest.raises(NumericalError, match="singular"):
        solve_spd(torch.zeros(3, 3), torch.ones(3, 1))


def test_nonfinite_counts_block_by_block_without_a_copy_of_the_tensor():
    """NaN and Inf are counted across block boundaries; checking a 256 MB tensor raises the process's peak by far
    less than ``torch.isfinite`` of the whole of it would (|T| and two masks: 640 MB)."""
    from spap_lib.numerics.linalg import nonfinite, nonfinite_parameters
    from spap_lib.numerics.memory import peak_rss_mb, reset_peak_rss, rss_mb

    T = torch.zeros(10, 7)
    T[0, 0], T[3, 5], T[9, 6] = float("nan"), float("inf"), -float("inf")
    assert nonfinite(T, block=8) == (1, 2) == nonfinite(T.T, block=3)  # a transposed view is counted too
    assert nonfinite(torch.ones(5)) == (0, 0)
    model = torch.nn.Linear(7, 10)
    with torch.no_grad():
        model.weight.copy_(T)
    assert nonfinite_parameters(model) == ["weight: 1 NaN, 2 Inf"]
    big = torch.ones(2**26)
    if not reset_peak_rss():
        pytest.skip("no resettable peak resident set here")
    before = rss_mb()
    assert nonfinite(big) == (0, 0)
    assert peak_rss_mb() - before < 128


def test_float32_solves_are_jacobi_scaled_and_match_float64():
    """Activation Gram matrices span many orders of magnitude (here 1e-6 … 1e6 on the diagonal): the
    float32 solve (scaled to unit diagonal) matches the float64 one."""
    from spap_lib.numerics.solve import solve_spd

    g = torch.Generator().manual_seed(0)
    Z = torch.randn(40, 400, generator=g, dtype=torch.float64) * torch.logspace(-3, 3, 40, dtype=torch.float64)[:, None]
    H = Z @ Z.T
    B = torch.randn(40, 5, generator=g, dtype=torch.float64)
    exact = solve_spd(H.clone(), B)
    got = solve_spd(H.float().clone(), B.float()).double()
    assert got.dtype == torch.float64 and torch.allclose(got, exact, rtol=1e-3, atol=1e-3 * exact.abs().max())


@pytest.mark.parametrize("entry", ["solve_spd", "ridge"])
def test_float32_falls_back_to_float64_where_its_factorization_fails(monkeypatch, entry):
    """When the float32 Cholesky reports a failed pivot, the same (scaled) system is solved in float64: rebuilt by
    ``ridge`` (its factorisation overwrote the first), from a copy kept by ``solve_spd`` called alone."""

    g = torch.Generator().manual_seed(1)
    Z = torch.randn(6, 50, generator=g, dtype=torch.float64)
    A, B = Z @ Z.T, torch.randn(6, 2, generator=g, dtype=torch.float64)
    real, calls = torch.linalg.cholesky_ex, []

    def failing_in_float32(M, *, out):
        calls.append(M.dtype)
        real(M, out=out)
        if M.dtype == torch.float32:
            out[1].fill_(1)
        return out

    monkeypatch.setattr(torch.linalg, "cholesky_ex", failing_in_float32)
    if entry == "ridge":
        got = solve.ridge(B.float().T, A.float(), torch.zeros(6)).T
    else:
        got = solve.solve_spd(A.float().clone(), B.float())
    assert calls == [torch.float32, torch.float64] and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), torch.linalg.solve(A, B), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_solves_factorise_in_place_with_the_numbers_of_a_copy(dtype):
    """``solve_spd`` factorises the system in its own memory: the factor and the solution are those of
    ``torch.linalg.cholesky`` on a copy and ``cholesky_solve``, to the bit (float32: of the same scaled system), for a
    system symmetric to the bit (a Gram sum of float32 products is, on this CPU)."""
    from spap_lib.numerics.solve import solve_spd

    g = torch.Generator().manual_seed(3)
    Z = torch.randn(300, 90, generator=g, dtype=dtype) * torch.logspace(-2, 2, 90, dtype=dtype)
    H, B = Z.T @ Z + (Z.T @ Z).T, torch.randn(90, 7, generator=g, dtype=dtype)  # symmetric to the bit
    s = H.diagonal().rsqrt() if dtype == torch.float32 else torch.ones(90, dtype=dtype)
    L = torch.linalg.cholesky(H * s[:, None] * s[None, :])  # the scaled system, factorised as a copy
    expected = torch.cholesky_solve(B * s[:, None], L) * s[:, None]
    A = H.clone()
    got = solve_spd(A, B)
    assert torch.equal(got, expected)
    assert torch.equal(torch.tril(A.mT), L)  # the factor, where the system was


def test_spap_float32_keeps_the_float64_channels_on_a_layer(loaded, windows):
    import spap_lib as sl
    from spap_lib.methods import LayerProblem
    from spap_lib.model.capture import first_layer_inputs, replay

    hidden, kwargs = first_layer_inputs(loaded.model, loaded.adapter.layers(), windows, 4, "cpu")
    layer = loaded.adapter.layers()[0]
    _, X = replay(layer, hidden, {b: kw[0] for b, kw in kwargs.items()}, 4,
                  watch=loaded.adapter.mlp_input_module(layer))
    results = {}
    for precision, dtype in (("float64", torch.float64), ("float32", torch.float32)):
        method = sl.get_method("spap", K=10, am_iters=0, precision=precision)
        problem = LayerProblem.of(method, loaded.adapter.get_mlp(layer), X, 20)
        results[precision] = method.prune(problem)
        assert problem.H.dtype == dtype
    assert torch.equal(results["float32"].keep, results["float64"].keep)
    torch.testing.assert_close(results["float32"].mlp.W_out, results["float64"].mlp.W_out, rtol=1e-3, atol=1e-3)


def test_resampled_rounds_draw_a_fresh_sample_each_round_and_rank_on_the_first(monkeypatch):
    """``resample``: every round's closed form sees its own token sample (so the rounds see more of the
    tokens than one sample holds), the rounds are ranked on the first sample, the best round is refitted
    on every token and never returned worse than the start."""
    pruned, X, Y = _update_problem()
    H, YZ = gram(pruned, X, 700, Y)
    samples = []
    real_gram = alternating.gram
    monkeypatch.setattr(alternating, "gram", lambda m, X_, *a, **k: samples.append(X_.clone()) or
                        real_gram(m, X_, *a, **k))
    out, errors = alternating_update(pruned, X, Y, _rounds(sketch_tokens=500, bf16=True, resample=True),
                                     **_start(pruned, Y, H, YZ))
    assert [len(x) for x in samples] == [500] * 4 + [3000]  # four sampled rounds, then the full refit
    seen = {tuple(row.tolist()) for x in samples[:4] for row in x}
    assert len(seen) > 1500  # four draws of 500 from 3000 tokens, not one sample four times
    err = float(((out(X) - Y).double() ** 2).sum() / (Y.double() ** 2).sum())
    assert err == pytest.approx(errors["final"], rel=1e-4) and errors["final"] < 0.9 * errors["start"]


def test_resampled_rounds_are_ranked_on_rank_tokens(monkeypatch):
    """With resampling the rounds are ranked by a forward pass on a sample of ``rank_tokens`` (0: ``sketch_tokens``);
    without it the one sample ranks the rounds it fits, and ``rank_tokens`` decides nothing."""
    import spap_lib as sl
    pruned, X, Y = _update_problem()
    H, YZ = gram(pruned, X, 700, Y)
    ranked, real = [], alternating.calibration_error
    monkeypatch.setattr(alternating, "calibration_error", lambda m, X_, *a, **k: ranked.append(len(X_)) or
                        real(m, X_, *a, **k))
    for rank_tokens, expected in ((200, 200), (0, 500)):
        ranked.clear()
        rounds = _rounds(adam_steps=5, sketch_tokens=500, bf16=True, resample=True, rank_tokens=rank_tokens)
        alternating_update(pruned.clone("cpu"), X, Y, rounds, **_start(pruned, Y, H, YZ))
        assert ranked == [expected] * 4
    assert "rank_tokens" in sl.get_method("spap").effective_hparams()
    assert "rank_tokens" not in sl.get_method("spap", sketch_resample=False).effective_hparams()
    assert "rank_tokens" not in sl.get_method("spap", sketch_tokens=0).effective_hparams()


def test_resampling_is_inert_for_gradient_descent():
    """``gd`` has no closed form to draw samples for: its resampling setting acts nowhere, so it is not part of
    the settings that decide a result (a grid row of either value is the same run)."""
    import spap_lib as sl

    for method, hparams in (("spap_gd", {"sketch_resample": False}), ("spap", {"update": "gd"})):
        assert "sketch_resample" not in sl.get_method(method, **hparams).effective_hparams()
    assert sl.get_method("spap_gd", sketch_resample=True).effective_hparams() == \
        sl.get_method("spap", update="gd", sketch_resample=False).effective_hparams()


def test_gram_blocks_sum_what_the_whole_product_does():
    """``add_gram`` adds ``Zᵀ Z`` on and above the diagonal a block of rows at a time (the temporary at most the size
    of ``Z``), chunks of any size into one matrix, and ``mirror`` completes it: exactly symmetric, and the whole
    product's numbers, in float32 and summed into float64. Below the diagonal blocks nothing is summed until
    ``mirror``."""
    from spap_lib.numerics.linalg import add_gram, mirror

    g = torch.Generator().manual_seed(4)
    Z = torch.randn(40, 100, generator=g) * torch.logspace(-2, 2, 100)
    whole = Z.double().T @ Z.double()
    for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-6)):
        H = torch.zeros(100, 100, dtype=dtype)
        add_gram(H, Z[:37])  # blocks of 13 rows
        add_gram(H, Z[37:])  # a chunk of 3 tokens: blocks of 3 rows
        assert not H[13:, :3].any()  # below the diagonal blocks nothing was summed
        mirror(H)
        assert torch.equal(H, H.T)
        assert torch.allclose(H.double(), whole, rtol=tol, atol=tol * float(whole.abs().max()))


def test_bf16_unit_products_sum_bf16_values_in_float32_and_restore_the_mode(monkeypatch):
    """``exact_bf16_products``: a Gram pass over bf16 values is their float32 Gram matrix (products of bf16 values
    are exact; only the sums' order may differ), and the process's float32 product mode is restored, on an error
    too. With the rounded kernels (a CPU without bf16 units) the mode is never touched."""
    from spap_lib.numerics.linalg import add_gram, exact_bf16_products, mirror

    H, mode = torch.zeros(40, 40), torch.backends.mkldnn.matmul.fp32_precision
    monkeypatch.setenv("SPAP_BF16_PRODUCTS", "rounded")
    with exact_bf16_products(True, "cpu"):
        assert torch.backends.mkldnn.matmul.fp32_precision == mode != "bf16"
    monkeypatch.setenv("SPAP_BF16_PRODUCTS", "native")
    Z = torch.randn(300, 40, generator=torch.Generator().manual_seed(0)).bfloat16().float()
    with exact_bf16_products(True, "cpu"):
        assert torch.backends.mkldnn.matmul.fp32_precision == "bf16"
        add_gram(H, Z)
    mirror(H)
    assert torch.backends.mkldnn.matmul.fp32_precision == mode
    exact = Z.double().T @ Z.double()
    assert float((H.double() - exact).abs().max()) <= 1e-6 * float(exact.abs().max())
    with pytest.raises(RuntimeError), exact_bf16_products(True, "cpu"):
        raise RuntimeError
    assert torch.backends.mkldnn.matmul.fp32_precision == mode
    with exact_bf16_products(False, "cpu"):  # off: nothing changes
        assert torch.backends.mkldnn.matmul.fp32_precision == mode


def _bf16_step(kernels: str, monkeypatch, bias: bool):
    """One forward and backward of a small GLU MLP under ``products`` with the given bf16 kernels; with how many
    linear layers the rounded float32 kernels computed."""
    from spap_lib.numerics import bf16
    from spap_lib.numerics.linalg import products

    monkeypatch.setenv("SPAP_BF16_PRODUCTS", kernels)
    calls, apply = [], bf16._Linear.apply
    monkeypatch.setattr(bf16._Linear, "apply", lambda *a: calls.append(1) or apply(*a))
    g = torch.Generator().manual_seed(0)
    X, Y = torch.randn(512, 48, generator=g), torch.randn(512, 48, generator=g)
    Ws = [(torch.randn(96, 48, generator=g) / 7).requires_grad_() for _ in range(2)]
    Wo = (torch.randn(48, 96, generator=g) / 10).requires_grad_()
    bo = (torch.randn(48, generator=g) / 10).requires_grad_() if bias else None
    with products(True, "cpu"):
        Z = torch.nn.functional.silu(torch.nn.functional.linear(X, Ws[0])) * torch.nn.functional.linear(X, Ws[1])
        out = torch.nn.functional.linear(Z, Wo, bias=bo)
        YZ = Y.T @ Z.detach().float()  # a product needing no gradient
        loss = torch.nn.functional.mse_loss(out.float(), Y)
    loss.backward()
    return out.detach(), YZ, [W.grad for W in (*Ws, Wo, *([bo] if bias else []))], len(calls)


@pytest.mark.parametrize("bias", [False, True])
def test_rounded_bf16_kernels_give_autocasts_products(monkeypatch, bias):
    """``bf16.autocast`` on a CPU without bf16 units: the float32 kernels on operands rounded to bf16 give autocast's
    bf16 products (the same dtypes; every value the same but where the sums' order rounds it to the next bf16 value:
    a handful in the forward, more in gradients, which carry those through the backward), and the gradients reach
    float32 weights in float32. Without rounding the operands, a quarter of the outputs differ."""
    from spap_lib.numerics.linalg import products

    native, YZ_native, grads_native, native_calls = _bf16_step("native", monkeypatch, bias)
    rounded, YZ_rounded, grads_rounded, rounded_calls = _bf16_step("rounded", monkeypatch, bias)
    assert (native_calls, rounded_calls) == (0, 3)
    assert rounded.dtype == native.dtype == YZ_rounded.dtype == YZ_native.dtype == torch.bfloat16

    def differ(a, b):
        return float((a.float() != b.float()).float().mean())

    ulp = 2.0 ** -7  # a bf16 value's relative spacing
    assert differ(rounded, native) < 0.01 and differ(YZ_rounded, YZ_native) < 0.01
    assert torch.allclose(rounded.float(), native.float(), rtol=ulp, atol=ulp * float(native.float().abs().max()))
    for a, b in zip(grads_rounded, grads_native):
        assert a.dtype == torch.float32 and differ(a, b) < 0.1
        assert torch.allclose(a, b, rtol=0.05, atol=0.05 * float(b.abs().max()))
        assert torch.equal(a, a.bfloat16().float())  # rounded to bf16, as autocast's are
    X = torch.randn(512, 48, generator=torch.Generator().manual_seed(0))
    W = torch.randn(96, 48, generator=torch.Generator().manual_seed(1))
    with products(True, "cpu"):
        bf16_products = torch.nn.functional.linear(X, W)
    assert differ(torch.nn.functional.linear(X, W).bfloat16(), bf16_products) > 0.2  # float32 operands, unrounded


def test_rounded_bf16_kernels_keep_float64_and_autocast_off_regions_and_refuse_a_bad_choice(monkeypatch):
    """Where autocast casts nothing (float64 operands, or a region that turns autocast off, as transformers' rotary
    frequencies do) the rounded kernels round nothing either; a wrong ``SPAP_BF16_PRODUCTS`` names the choices."""
    from spap_lib.errors import ParameterError
    from spap_lib.numerics import bf16
    from spap_lib.numerics.linalg import products

    monkeypatch.setenv("SPAP_BF16_PRODUCTS", "rounded")
    A = torch.randn(64, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    B = A.float()
    with products(True, "cpu"):
        doubles = torch.nn.functional.linear(A, A), A @ A
        with torch.autocast("cpu", enabled=False):
            floats = torch.nn.functional.linear(B, B), B @ B
    assert torch.equal(doubles[0], torch.nn.functional.linear(A, A)) and torch.equal(doubles[1], A @ A)
    assert torch.equal(floats[0], torch.nn.functional.linear(B, B)) and torch.equal(floats[1], B @ B)
    assert bf16.kernels("cpu") == "rounded" and bf16.kernels("meta") == "native"
    monkeypatch.setenv("SPAP_BF16_PRODUCTS", "native")
    assert bf16.kernels("cpu") == "native"
    monkeypatch.setenv("SPAP_BF16_PRODUCTS", "fast")
    with pytest.raises(ParameterError, match="auto, native, rounded"):
        bf16.kernels("cpu")
