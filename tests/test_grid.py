"""The ablation grid: calibrate once, prune many, resume, and figures drawn from the table only."""
import pandas as pd
import pytest
import torch
from conftest import calibration

import spap_lib as sl
import spap_lib.artifact.grid as grid_mod
from spap_lib.artifact.figure2 import figure2
from spap_lib.artifact.figures import headline, layer_plot, table5
from spap_lib.artifact.grid import Eval, Grid, Variant, record_run, run_grid
from spap_lib.errors import ParameterError
from spap_lib.methods.base import parse_label
from spap_lib.model.loading import Loaded
from spap_lib.model.sources import ModelSource
from spap_lib.pipeline.sequential import RunSettings


def _grid(arch, tokenizer, windows):
    from conftest import tiny_model

    from spap_lib.model.adapters import get_adapter

    model = tiny_model(arch)
    loaded = Loaded(model, tokenizer, get_adapter(model), ModelSource(f"tiny-{arch}", "dir", "-"), torch.device("cpu"))
    calib = calibration(windows)
    return Grid(f"tiny-{arch}", loaded, calib, RunSettings(progress=False))


def test_grid_shares_dense_statistics_and_resumes(tiny_tokenizer, windows, tmp_path, monkeypatch):
    calls = []
    real = grid_mod.dense_stats
    monkeypatch.setattr(grid_mod, "dense_stats", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = _grid("llama", tiny_tokenizer, windows)
    variants = [Variant.parse(v, {"spap": {"K": 3, "am_iters": 1, "adam_steps": 1, "batch_tokens": 16}})
                for v in ["magnitude", "wanda_sp", "flap/allocation=uniform", "cfsp", "fasp", "spap"]]
    csv = tmp_path / "ablation.csv"
    table = run_grid(g, variants, [0.2, 0.4], [16], 2, csv)
    assert len(calls) == 1  # four score methods x two sparsities, one dense pass
    assert len(table) == 1 + 6 * 2 and set(table["label"]) == {"dense", *(v.label for v in variants)}
    pruned = table[table["label"] != "dense"]
    assert pruned.groupby("sparsity")["mlp_channel_ratio"].nunique().eq(1).all()  # one budget for all
    assert set(pruned[pruned["method"].isin(["fasp", "spap"])]["propagate"]) == {True}
    assert set(pruned[pruned["method"].isin(["magnitude", "wanda_sp", "flap", "cfsp"])]["propagate"]) == {False}
    assert pruned["ppl"].map(lambda p: 1 < p < float("inf")).all()
    # Resume: nothing left to do, so nothing is pruned again and no row is added.
    monkeypatch.setattr(Grid, "prune", lambda *a, **k: pytest.fail("recomputed a finished cell"))
    again = run_grid(g, variants, [0.2, 0.4], [16], 2, csv)
    assert len(again) == len(table)
    assert len(pd.read_csv(csv)) == len(table)
    # resume=False recomputes the cells asked for and replaces their rows, keeping every other row.
    monkeypatch.undo()
    redo = run_grid(g, variants[:1], [0.2], [16], 2, csv, resume=False)
    assert len(redo) == len(table) and len(pd.read_csv(csv)) == len(table)


def test_a_grid_measures_an_error_allocations_curves_once_per_variant(tiny_tokenizer, windows, tmp_path, monkeypatch):
    """The error curves do not depend on the sparsity: one curve pass per variant serves all its cells."""
    curves = []
    real = grid_mod.dense_stats
    monkeypatch.setattr(grid_mod, "dense_stats", lambda *a, **k: curves.append(k.get("curve")) or real(*a, **k))
    g = _grid("llama", tiny_tokenizer, windows)
    variants = [Variant.parse(v) for v in ["fasp/allocation=error", "fasp/allocation=error,update=none"]]
    table = run_grid(g, variants, [0.2, 0.4], [16], 2, tmp_path / "t.csv")
    assert len(curves) == 2 and all(c is not None for c in curves)
    pruned = table[table["label"] != "dense"]
    assert len(pruned) == 4 and (pruned["uniform_width"] == False).any()  # noqa: E712 (a pandas column)
    # every cell records what its widths cost, the shared curve pass included (a prune alone would pay it)
    assert (pruned["allocation_seconds"] > 0).all() and table.set_index("label").loc["dense", "allocation_seconds"] == 0
    uniform = run_grid(g, [Variant.parse("fasp")], [0.2], [16], 2, tmp_path / "u.csv")
    assert (uniform["allocation_seconds"] == 0).all()


def test_grid_skips_unsupported_cells_with_a_reason(tiny_tokenizer, windows, tmp_path, capsys):
    g = _grid("gemma3", tiny_tokenizer, windows)
    table = run_grid(g, [Variant.parse("flap"), Variant.parse("flap/bias=false")], [0.2], [16], 2, tmp_path / "t.csv")
    assert list(table["label"]) == ["dense", "flap/bias=false"]
    assert "flap: skipped" in capsys.readouterr().out


def test_figure_and_table_come_from_the_csv_alone(tmp_path):
    rows = [{"model": m, "label": label, "method": label.split("/")[0], "sparsity": s, "eval_seqlen": 512,
             "ppl": base * (1 + s) * (10 if label == "magnitude" else 1)}
            for m, base in (("a", 20.0), ("b", 30.0))
            for label, sps in (("dense", [0.0]), ("magnitude", [0.1, 0.2]), ("spap", [0.1, 0.2]),
                               ("flap/allocation=uniform", [0.1, 0.2]))
            for s in sps]
    csv = tmp_path / "r.csv"
    pd.DataFrame(rows).to_csv(csv, index=False)
    fig = figure2(csv, tmp_path / "fig.png")
    assert (tmp_path / "fig.png").stat().st_size > 10_000 and len(fig.axes) == 2
    wide = headline(csv)
    assert list(wide.loc[("a", "", 512, 40)].index) == ["dense", "magnitude", "flap/allocation=uniform", "spap"]
    assert wide.loc[("b", "", 512, 40, "spap"), 0.2] == pytest.approx(36.0)
    # A cell measured under another protocol (calibration size, test windows) is its own row, never
    # averaged into the grid's, and stays out of the figure.
    more = [{**rows[-1], "ppl": 1e4, "nsamples": 128, "seqlen": 512}]
    pd.DataFrame([{**r, "nsamples": 32, "seqlen": 512} for r in rows] + more).to_csv(csv, index=False)
    wide = headline(csv)
    assert wide.loc[("b", "32×512", 512, 40, "spap"), 0.2] == pytest.approx(36.0)
    assert wide.loc[("b", "128×512", 512, 40, rows[-1]["label"]), rows[-1]["sparsity"]] == 1e4
    fig = figure2(csv, tmp_path / "fig.png")
    assert max(max(line.get_ydata(), default=0) for ax in fig.axes for line in ax.get_lines()) < 1e4


def test_a_small_grid_gets_its_figure_and_a_table_of_dense_rows_alone_is_refused(tmp_path):
    """A few methods at one sparsity (fewer cells than a panel of the full grid needs) still draw; a table with
    no pruned cell names what to run instead of failing in the plotting code."""
    rows = [{"model": "m", "label": label, "method": label.split("/")[0], "sparsity": s, "eval_seqlen": 128,
             "eval_windows": 4, "nsamples": 8, "seqlen": 256, "ppl": p}
            for label, s, p in (("dense", 0.0, 45.0), ("spap", 0.2, 117.0), ("spap_gd", 0.2, 131.0))]
    csv = tmp_path / "r.csv"
    pd.DataFrame(rows).to_csv(csv, index=False)
    fig = figure2(csv, tmp_path / "fig.png")
    assert len(fig.axes) == 1 and (tmp_path / "fig.png").stat().st_size > 10_000
    pd.DataFrame(rows[:1]).to_csv(csv, index=False)
    with pytest.raises(ParameterError, match="no pruned cell at eval_seqlen 128.*prune=True"):
        figure2(csv, tmp_path / "empty.png")
    assert not (tmp_path / "empty.png").exists()


def test_figure2_draws_each_method_at_its_own_parts_and_the_best_compositions(tmp_path):
    """The lines: the methods' own rows (the most-measured label, the bare one on a tie: a bare row at one sparsity
    does not replace a sweep), and every label that is the best with SPAP's alternating update in a cell;
    ablations and other compositions stay out."""
    ppl = {"fasp": 30.0, "spap_no_update": 29.0, "flap/bias=false": 31.0, "spap": 25.0, "spap/lr=0.01": 26.0,
           "spap/select=act_norm": 24.0, "cfsp": 32.0, "cfsp/allocation=uniform": 33.0}
    cells = {"cfsp": (0.3,)}
    rows = [{"model": "m", "label": label, "method": label.split("/")[0], "sparsity": s, "eval_seqlen": 512,
             "eval_windows": 40, "nsamples": 32, "seqlen": 512, "ppl": p * (1 + s)}
            for label, p in ppl.items() for s in cells.get(label, (0.1, 0.2))]
    csv = tmp_path / "r.csv"
    pd.DataFrame(rows).to_csv(csv, index=False)
    fig = figure2(csv, tmp_path / "fig.png")
    (ax,) = fig.axes
    names = [t.get_text() for t in ax.get_legend().get_texts()]
    # the paper's order, SPAP last; its best composition (act-norm channels beat lr=0.01, which changes no part)
    assert names == ["FLAP, bias=false", "CFSP, uniform widths", "FASP", "SPAP", "SPAP, act-norm channels"]
    spap, composition = (line for line in ax.get_lines() if line.get_label().startswith("SPAP"))
    assert spap.get_color() == composition.get_color() == "#d62728" and composition.get_linestyle() == "--"
    assert spap.get_linewidth() > next(line for line in ax.get_lines() if line.get_label() == "FASP").get_linewidth()


def test_figure2_names_a_composition_as_a_person_reads_it():
    from spap_lib.artifact.figure2 import readable

    assert readable("spap/select=act_norm,allocation=angular") == "SPAP, act-norm channels, angular widths"
    assert readable("spap/lr=0.001,lr_scale=absolute,sketch_tokens=0,update_precision=full") == \
        "SPAP, the paper's update"
    assert readable("flap/bias=false") == "FLAP, bias=false" and readable("wanda_sp") == "Wanda-SP"


def test_table5_lists_the_ablated_cells_with_their_increase_over_dense(tmp_path):
    rows = [{"model": "m", "label": label, "method": label, "sparsity": s, "eval_seqlen": 512, "eval_windows": 40,
             "nsamples": 32, "seqlen": 512, "ppl": ppl}
            for label, s, ppl in (("dense", 0.0, 20.0), ("fasp", 0.2, 30.0), ("spap_no_update", 0.2, 29.0),
                                  ("spap", 0.2, 25.0), ("fasp", 0.3, 40.0), ("spap", 0.3, 35.0))]
    rows.append({**rows[3], "nsamples": 128, "ppl": 24.0, "label": "spap_gd", "method": "spap_gd"})
    csv = tmp_path / "r.csv"
    pd.DataFrame(rows).to_csv(csv, index=False)
    t = table5(csv).set_index(["calib", "sparsity"])
    assert list(t.index) == [("128×512", 0.2), ("32×512", 0.2)]  # 30% has no ablation: the sweep's, not Table 5's
    assert t.loc[("32×512", 0.2), "spap"] == "25.00 (+25.0%)" and t.loc[("32×512", 0.2), "spap_gd"] == ""
    assert t.loc[("128×512", 0.2), "spap_gd"] == "24.00 (+20.0%)"  # dense is the same model and test windows


def test_tables_name_each_row_by_the_settings_it_ran_with(tmp_path):
    """After a default changes, the rows made with the old one are shown under their old values, and a row
    that ran today's default under an explicit label is shown as the bare method."""
    import json

    from spap_lib.artifact.figures import headline

    lr = sl.get_method("spap").lr
    old = lr / 2  # a row made when the default was this

    def row(label, hparams, ran, ppl):
        full = {**sl.get_method("spap").hparams(), **ran}
        return {"model": "m", "label": label, "method": label.split("/")[0], "sparsity": 0.2, "eval_seqlen": 512,
                "eval_windows": 40, "nsamples": 32, "seqlen": 512, "ppl": ppl, "hparams": json.dumps(hparams),
                "resolved_hparams": json.dumps(full)}
    csv = tmp_path / "r.csv"
    pd.DataFrame([row("spap", {}, {"lr": old}, 30.0), row(f"spap/lr={lr}", {"lr": lr}, {}, 29.0),
                  row("spap/K=5", {"K": 5}, {"K": 5, "lr": old}, 31.0), row("spap/K=7", {"K": 7}, {"K": 7}, 32.0),
                  {**row("dense", {}, {}, 20.0), "method": "dense", "resolved_hparams": "{}", "sparsity": 0.0},
                  ]).to_csv(csv, index=False)
    table = headline(csv)
    assert set(table.reset_index()["label"]) == {"dense", f"spap/lr={old}", "spap", f"spap/K=5,lr={old}", "spap/K=7"}
    assert table.loc[("m", "32×512", 512, 40, "spap"), 0.2] == 29.0  # today's default, whatever its label said


def test_the_parts_table_and_the_best_composition_against_the_best_baseline(tmp_path):
    """Every label is shown as its three parts (baselines too), and per cell the best composition with SPAP's
    alternating update is compared with the best baseline, the best uniform-width one reported apart."""
    import json

    from spap_lib.artifact.figures import best_compositions, compositions

    def row(label, sparsity, ppl):
        method, hparams = parse_label(label)
        return {"model": "m", "label": label, "method": method, "sparsity": sparsity, "eval_seqlen": 512,
                "eval_windows": 40, "nsamples": 32, "seqlen": 512, "ppl": ppl, "hparams": json.dumps(hparams),
                "resolved_hparams": json.dumps(sl.get_method(label).hparams())}
    cells = {"cfsp": (30.0, 40.0), "fasp": (31.0, 39.0), "spap_no_update": (30.5, 38.0), "spap": (30.8, 38.5),
             "spap/allocation=error": (29.0, 37.0), "spap/select=act_norm": (29.5, 38.2),
             "flap/bias=false": (33.0, 44.0)}
    csv = tmp_path / "r.csv"
    pd.DataFrame([row(label, s, ppl) for label, ppls in cells.items() for s, ppl in zip((0.1, 0.2), ppls)]
                 + [{**row("spap", 0.0, 20.0), "label": "dense", "method": "dense", "resolved_hparams": "{}"}]
                 ).to_csv(csv, index=False)
    parts = compositions(csv).set_index("label")
    assert list(parts.loc["cfsp", ["select", "allocation", "update"]]) == ["act_norm", "angular", "none"]
    assert list(parts.loc["spap/select=act_norm", ["select", "allocation", "update"]]) == \
        ["act_norm", "uniform", "alternating"]
    assert parts.loc["flap/bias=false", "settings"] == "bias=false" and parts.loc["fasp", "update"] == "ls"
    assert parts.loc["spap/allocation=error", 0.1] == 29.0 and "dense" not in parts.index
    best = best_compositions(csv).set_index("sparsity")
    assert best.loc[0.1, "best baseline"] == "cfsp" and best.loc[0.1, "lead"] == pytest.approx(1.0)
    assert best.loc[0.2, "best baseline"] == "fasp"  # spap_no_update is an ablation, not a baseline
    assert best.loc[0.2, "best with alternating update"] == "spap/allocation=error"
    assert best.loc[0.2, "best uniform-width"] == "spap/select=act_norm" and best.loc[0.2, "uniform ppl"] == 38.2
    assert best.loc[0.1, "best uniform-width"] == "spap/select=act_norm"


def test_table3_keeps_each_number_of_examples_apart_and_carries_the_stderr():
    """The same checkpoint scored on 100 examples per task and on the whole splits is two rows of Table 3,
    never their average; the mean's standard error is that of a mean of independent task estimates."""
    from spap_lib.evaluation.zeroshot import SUMMARY_METRIC, table3

    rows = []
    for limit, acc, se in ((100, 0.50, 0.05), (-1, 0.40, 0.01)):
        for task, metric in SUMMARY_METRIC.items():
            rows.append({"model": "m", "method": "spap", "sparsity": 0.2, "task": task, "metric": metric,
                         "value": acc, "stderr": se, "limit": limit})
            other = "acc_norm" if metric == "acc" else "acc"  # the long table's other metric is not averaged in
            rows.append({**rows[-1], "metric": other, "value": 0.99})
        rows.append({"model": "m", "method": "spap", "sparsity": 0.2, "task": "wikitext2", "metric": "ppl@2048",
                     "value": 30.0 + limit, "stderr": float("nan"), "limit": limit})
    df = pd.DataFrame(rows)
    t = table3(df)
    assert t.loc[("m", "spap", 0.2, 100), "mean"] == 50.0 and t.loc[("m", "spap", 0.2, -1), "mean"] == 40.0
    assert t.loc[("m", "spap", 0.2, -1), "ppl@2048"] == 29.0
    s = table3(df, stderr=True)
    assert s.loc[("m", "spap", 0.2, -1), "piqa"] == "40.00 ± 1.00"
    assert s.loc[("m", "spap", 0.2, 100), "mean"] == f"50.00 ± {(6 * 5.0**2) ** 0.5 / 6:.2f}"  # 2.04


def test_layer_plot_draws_what_each_method_records():
    import matplotlib.pyplot as plt

    spap = {"layers": [{"layer": i, "removed": 3, "rel_error_penalty": 0.1 / (i + 1), "rel_error_final": 0.05 / (i + 1)}
                       for i in range(4)]}
    ax = layer_plot(spap, "spap").axes[0]
    assert [list(line.get_ydata()) for line in ax.get_lines()][1] == [0.05 / (i + 1) for i in range(4)]
    assert ax.get_yscale() == "log"
    # No per-layer error (score methods, FASP): the allocation, not an empty log-scale axis.
    flap = {"layers": [{"layer": i, "removed": r} for i, r in enumerate([5, 1, 0, 7])]}
    ax = layer_plot(flap, "flap").axes[0]
    assert [p.get_height() for p in ax.patches] == [5, 1, 0, 7] and not ax.get_lines()
    sliced = {"layers": [{"in": 8, "mid": 8, "out": 8}] * 3}
    ax = layer_plot(sliced, "slicegpt").axes[0]
    assert list(ax.get_lines()[0].get_ydata()) == [8, 8, 8] and "residual" in ax.get_ylabel()
    plt.close("all")


def test_extra_protocols_apply_to_their_cells_only(tiny_tokenizer, windows, tmp_path, monkeypatch):
    g = _grid("llama", tiny_tokenizer, windows)
    # (windows None, the whole split, works the same; 5 windows keep the test fast)
    extra = Eval.parse({"seqlen": 32, "windows": 5, "labels": ["dense", "wanda_sp"], "sparsities": [0.2]})
    csv = tmp_path / "t.csv"
    table = run_grid(g, [Variant.parse("magnitude"), Variant.parse("wanda_sp")], [0.2, 0.4], [16], 2, csv,
                     extra_evals=[extra])
    got = set(zip(table["label"], table["sparsity"], table["eval_seqlen"], table["eval_windows"]))
    whole = ("dense", 0.0, 32, 5), ("wanda_sp", 0.2, 32, 5)
    assert got == {("dense", 0.0, 16, 2), ("magnitude", 0.2, 16, 2), ("magnitude", 0.4, 16, 2),
                   ("wanda_sp", 0.2, 16, 2), ("wanda_sp", 0.4, 16, 2), *whole}
    assert Eval.parse({"seqlen": 2048, "windows": None}).windows is None
    # Adding a protocol later re-prunes only the cells it applies to.
    pruned = []
    real = Grid.prune
    monkeypatch.setattr(Grid, "prune", lambda self, v, s: pruned.append((v.label, s)) or real(self, v, s))
    later = Eval.parse({"seqlen": 8, "windows": 3, "labels": ["magnitude"]})
    run_grid(g, [Variant.parse("magnitude"), Variant.parse("wanda_sp")], [0.2, 0.4], [16], 2, csv,
             extra_evals=[extra, later])
    assert pruned == [("magnitude", 0.2), ("magnitude", 0.4)]
    with pytest.raises(ValueError, match="bad extra evaluation .* expected keys seqlen"):
        Eval.parse({"seqlen": 8, "window": 3})
    with pytest.raises(ValueError, match=r"names \['spap'\], which the grid does not run .* sets extra_evals: \[\]"):
        Eval.parse({"seqlen": 8, "labels": ["dense", "spap"]}, labels=["magnitude"])


def test_rows_record_every_hyperparameter_and_a_changed_default_reruns_the_cell(tiny_tokenizer, windows, tmp_path,
                                                                                 monkeypatch):
    """``hparams`` holds a label's overrides; ``resolved_hparams`` what the cell really ran with. When a default
    changes later, the grid recomputes that cell and replaces its stale row; rows from before the column
    existed (nothing recorded) stay done."""
    import json

    from spap_lib.methods import METHODS

    g = _grid("llama", tiny_tokenizer, windows)
    csv = tmp_path / "t.csv"
    variants = [Variant.parse("magnitude"), Variant.parse("wanda_sp/allocation=global")]
    table = run_grid(g, variants, [0.2], [16], 2, csv)
    rows = table.set_index("label")
    assert json.loads(rows.loc["wanda_sp/allocation=global", "hparams"]) == {"allocation": "global"}
    assert json.loads(rows.loc["wanda_sp/allocation=global", "resolved_hparams"]) == \
        sl.get_method("wanda_sp", allocation="global").hparams()
    assert rows.loc["dense", "resolved_hparams"] == "{}"
    pruned = []
    real = Grid.prune
    monkeypatch.setattr(Grid, "prune", lambda self, v, s: pruned.append(v.label) or real(self, v, s))
    monkeypatch.setattr(METHODS["magnitude"], "hparams", lambda self: {"a_new_default": 1})
    again = run_grid(g, variants, [0.2], [16], 2, csv)
    assert pruned == ["magnitude"] and len(again) == len(table)
    assert again.set_index("label").loc["magnitude", "resolved_hparams"] == '{"a_new_default": 1}'
    # a row written before the column existed: nothing recorded, nothing recomputed
    old = pd.read_csv(csv, keep_default_na=False).drop(columns=["resolved_hparams", "row_sha256"])  # unsigned, as then
    old.to_csv(csv, index=False)
    monkeypatch.setattr(METHODS["magnitude"], "hparams", lambda self: {"another_default": 2})
    run_grid(g, variants, [0.2], [16], 2, csv)
    assert pruned == ["magnitude"]


def test_rows_of_another_tokenizer_are_run_again(tiny_tokenizer, windows, tmp_path, monkeypatch):
    """A row records the digest of the tokenizer its ids came from. A grid whose tokenizer splits text otherwise
    (spap's own split of a GGUF's: ``gguf_tokenizer.rebuilt``) runs the cell again and replaces the row; a row from
    before the column counts only while spap's tokenizer is still transformers' build."""
    import copy

    from tokenizers import pre_tokenizers

    from spap_lib.keys import tokenizer_digest

    g = _grid("llama", tiny_tokenizer, windows)
    csv = tmp_path / "t.csv"
    table = run_grid(g, [Variant.parse("magnitude")], [0.2], [16], 2, csv)
    assert set(table["tokenizer"]) == {tokenizer_digest(tiny_tokenizer)}
    pruned = []
    real = Grid.prune
    monkeypatch.setattr(Grid, "prune", lambda self, v, s: pruned.append(v.label) or real(self, v, s))
    run_grid(g, [Variant.parse("magnitude")], [0.2], [16], 2, csv)
    assert pruned == []  # the same tokenizer: done
    other = copy.deepcopy(tiny_tokenizer)
    other.backend_tokenizer.pre_tokenizer = pre_tokenizers.Digits(individual_digits=True)
    other.spap_rebuilt = True
    g.tokenizer = (tokenizer_digest(other), True)
    again = run_grid(g, [Variant.parse("magnitude")], [0.2], [16], 2, csv)
    assert pruned == ["magnitude"] and len(again) == len(table)  # replaced, not added
    assert set(again["tokenizer"]) == {tokenizer_digest(other)}  # the dense row measured again too
    old = pd.read_csv(csv, keep_default_na=False).drop(columns=["tokenizer", "row_sha256"])  # unsigned, as then
    old.to_csv(csv, index=False)
    run_grid(g, [Variant.parse("magnitude")], [0.2], [16], 2, csv)
    assert pruned == ["magnitude", "magnitude"]  # recorded before the column, and spap now splits otherwise
    g.tokenizer = (tokenizer_digest(tiny_tokenizer), False)
    old.to_csv(csv, index=False)
    run_grid(g, [Variant.parse("magnitude")], [0.2], [16], 2, csv)
    assert pruned == ["magnitude", "magnitude"]  # transformers' build all along: done


def test_an_option_added_later_makes_a_row_stale_only_where_it_acts():
    """A row records every hyperparameter it ran with. One added since (absent from the record) makes the
    row stale where it changes the result, not where the row's own settings make it inert."""
    import json

    from spap_lib.artifact.cells import effective, ran_with

    def recorded(method, hparams, drop):
        return json.dumps({k: v for k, v in sl.get_method(method, **hparams).hparams().items() if k not in drop})

    paper = {"sketch_tokens": 0, "update_precision": "full"}
    assert ran_with(recorded("spap", paper, {"sketch_resample"}), effective("spap", paper))  # no sample to redraw
    assert not ran_with(recorded("spap", {}, {"sketch_resample"}), effective("spap", {}))  # the default redraws
    update = {"sketch_tokens", "update_precision", "sketch_resample"}
    assert ran_with(recorded("spap_no_update", {}, update), effective("spap_no_update", {}))  # no update stage
    assert not ran_with(recorded("spap_no_update", {"K": 5}, ()), effective("spap_no_update", {}))  # K acts
    assert ran_with("", effective("spap", {})) and ran_with("{}", effective("dense", {}))
    # The parts (select, allocation, update) arrived as options defaulting to each method's own: a row recorded
    # before them ran its preset, and is stale only for another composition.
    from spap_lib.artifact.cells import before

    old_fasp = json.dumps({"damp": 0.001, "precision": "auto"})
    assert ran_with(old_fasp, effective("fasp", {}), before("fasp"))
    assert not ran_with(old_fasp, effective("fasp", {"update": "none"}), before("fasp"))
    assert not ran_with(old_fasp, effective("fasp", {}))  # without knowing what was introduced: stale
    old_spap = recorded("spap", {}, {"select", "update", "score_scale", "allocation", "error_tokens"})
    assert ran_with(old_spap, effective("spap", {}), before("spap"))
    assert not ran_with(old_spap, effective("spap", {"score_scale": "layer"}), before("spap"))
    older = recorded("spap", {}, {"patience", "rank_tokens"})  # options whose default is the earlier behaviour
    assert ran_with(older, effective("spap", {}), before("spap"))
    assert not ran_with(older, effective("spap", {"patience": 3}), before("spap"))


def test_a_cell_run_under_another_label_with_the_same_settings_is_not_run_again():
    import json

    from spap_lib.artifact.cells import KEY, effective
    from spap_lib.artifact.cells import done as _done

    lr = sl.get_method("spap").lr
    cell = {"model": "m", "sparsity": 0.2, "eval_seqlen": 512, "eval_windows": 40, "nsamples": 32, "seqlen": 512,
            "seed": 0}
    ran = {**cell, "label": f"spap/lr={lr}", "method": "spap", "hparams": json.dumps({"lr": lr}),
           "resolved_hparams": json.dumps(sl.get_method("spap").hparams())}
    table = pd.DataFrame([ran])
    probe = lambda label, hp: {**cell, "label": label, "hparams": json.dumps(hp)}  # noqa: E731
    assert set(KEY) <= set(probe("spap", {}))
    assert _done(table, probe("spap", {}), "spap", effective("spap", {}))  # today's default: the same run
    assert not _done(table, probe("spap/K=5", {"K": 5}), "spap", effective("spap", {"K": 5}))
    assert not _done(table, probe("spap_gd", {}), "spap_gd", effective("spap_gd", {}))  # another method
    assert not _done(table.assign(eval_windows=10), probe("spap", {}), "spap", effective("spap", {}))


def test_every_run_keeps_its_manifest(tmp_path):
    import json

    csv = tmp_path / "ablation.csv"
    csv.with_suffix(".manifest.json").write_text(json.dumps({"notebook": "03_ablate", "models": ["old"]}))
    record_run(csv, models=["a"])
    path = record_run(csv, models=["b"])
    runs = json.loads(path.read_text())["runs"]
    assert [r["models"] for r in runs] == [["old"], ["a"], ["b"]] and "git_revision" in runs[-1]


def test_a_grid_cell_interrupted_mid_way_resumes_by_layer(tiny_tokenizer, windows, tmp_path, monkeypatch):
    from spap_lib.methods.fasp import FASP

    g = _grid("llama", tiny_tokenizer, windows)
    g.resume_root = tmp_path / "progress"
    real = FASP.prune
    monkeypatch.setattr(FASP, "prune", lambda self, p: (_ for _ in ()).throw(KeyboardInterrupt)
                        if p.layer_index == 2 else real(self, p))
    with pytest.raises(KeyboardInterrupt):
        run_grid(g, [Variant.parse("fasp")], [0.2], [16], 2, tmp_path / "t.csv")
    saved = g.resume_dir(Variant.parse("fasp"), 0.2)
    assert saved.parent == tmp_path / "progress" / "tiny-llama" and saved.name.startswith("fasp_0.2-4x24-seed0-")
    assert (saved / "state.json").is_file()
    layers = []
    monkeypatch.setattr(FASP, "prune", lambda self, p: layers.append(p.layer_index) or real(self, p))
    table = run_grid(g, [Variant.parse("fasp")], [0.2], [16], 2, tmp_path / "t.csv")
    assert layers == [2] and not saved.exists() and list(table["label"]) == ["dense", "fasp"]
    # the row says its time is of layers 2.. only (the first process's layers ran before it)
    assert list(table["resumed_at_layer"]) == [0, 2]


def test_each_calibration_budget_is_its_own_panel_and_the_paper_stands_beside_ours(tmp_path):
    from spap_lib.artifact.figures import beside_paper

    rows = [{"model": "smollm2-135m", "label": label, "method": label, "sparsity": s, "eval_seqlen": 512,
             "eval_windows": 40, "nsamples": n, "seqlen": 512, "ppl": 20.0 * (1 + s) * (1.1 if n == 32 else 1.0)}
            for n in (32, 128) for label in ("fasp", "spap", "cfsp") for s in (0.1, 0.2, 0.3)]
    rows.append({**rows[0], "label": "dense", "method": "dense", "sparsity": 0.0, "ppl": 20.0})
    csv = tmp_path / "r.csv"
    pd.DataFrame(rows).to_csv(csv, index=False)
    fig = figure2(csv, tmp_path / "fig.png")
    titles = [ax.get_title() for ax in fig.axes if ax.get_visible()]
    assert titles == ["smollm2-135m (calibration 32×512)", "smollm2-135m (calibration 128×512)"]
    paper = tmp_path / "paper.csv"
    pd.DataFrame([{"table": "table2", "model": "llama-3.2-1b", "method": m, "sparsity": s, "metric": "wikitext2_ppl",
                   "value": v} for m, s, v in (("dense", 0, 10.0), ("spap", 0.2, 12.5), ("fasp", 0.2, 13.0))]
                 ).to_csv(paper, index=False)
    t = beside_paper(csv, paper, "128×512").set_index("method")
    assert list(t.index) == ["dense", "cfsp", "fasp", "spap"]
    assert t.loc["spap", "20% ours"] == "24.00 (+20.0%)" and t.loc["spap", "20% paper"] == "12.50 (+25.0%)"
    assert t.loc["cfsp", "20% paper"] == "" and t.loc["dense", "20% paper"] == "10.00"
