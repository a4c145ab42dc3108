"""Figures and tables drawn only from result tables (CSV), so they regenerate without pruning."""
from __future__ import annotations

import re
from pathlib import Path

import pandas as pd

from spap_lib.errors import TableError

# The paper's own method and its ablations (Table 5), each ablation with the method it ablates: figures and tables
# list the baselines first (one-shot scores, then the propagating ones), then the ablations, then the method.
OURS = "spap"
ABLATIONS = {"spap_no_update": "spap", "spap_gd": "spap"}


def ablation_of(method: str) -> str | None:
    """The method that ``method`` ablates (Table 5), or None."""
    return ABLATIONS.get(method)


def is_ours(method: str) -> bool:
    """The paper's method or one of its ablations (not a baseline)."""
    return method == OURS or method in ABLATIONS


def method_order() -> list[str]:
    """Every registered method in the paper's order: one-shot score baselines, then the propagating baselines
    (FASP), then the ablations, then the paper's method (each group in registration order)."""
    from spap_lib.methods import METHODS

    def group(name: str) -> int:
        return 3 if name == OURS else 2 if name in ABLATIONS else 1 if METHODS[name].propagates else 0
    return sorted(METHODS, key=group)


def _label_order(labels) -> list[str]:
    order = method_order()

    def rank(label: str):
        method = label.split("/")[0]
        return (order.index(method) if method in order else len(order), label)
    return sorted(set(labels) - {"dense"}, key=rank)


def load_rows(results_csv: str | Path) -> pd.DataFrame:
    """The grid's rows as every figure and table reads them: protocol columns (``_protocol``) and exact labels
    (``exact_labels``)."""
    from spap_lib.artifact.table import SHOWN, read

    table = read(results_csv, SHOWN, keep_default_na=False)
    if table.empty:
        raise TableError(f"{results_csv} has no rows: run the grid (03_ablate) first, or give another results_csv")
    table = exact_labels(_protocol(table))
    shown = ["model", "calib", "eval_seqlen", "eval_windows", "label", "sparsity"]
    twice = table[table.duplicated(shown, keep=False)]
    if len(twice):  # e.g. an old default's row relabelled onto a row of today's: never averaged into one number
        first = twice.iloc[0]
        cell = ", ".join(f"{k} {first[k]}" for k in shown)
        raise TableError(f"{results_csv}: {len(twice)} rows would show as one cell ({cell}"
                         f"; hparams {', '.join(sorted(set(twice['hparams'])))}): delete all but one of them")
    return table


def exact_labels(table: pd.DataFrame) -> pd.DataFrame:
    """A row's label names the settings it ran with, against today's defaults. A row made before a default
    changed (its recorded hyperparameters differ from today's where they act, ``grid.effective``) is
    relabelled with the values it ran, e.g. ``spap/lr=0.005`` (``option=unset``: made before the option
    existed), and one whose overrides are today's defaults takes the bare method name. So no table shows an
    old default's row under the current default's name, and the current default's rows under one name."""
    import json

    from spap_lib.artifact.cells import before, effective, ran_with
    from spap_lib.methods import get_method

    if "resolved_hparams" not in table or not len(table):
        return table

    def label(row) -> str:
        if row["method"] == "dense" or not row["resolved_hparams"]:
            return row["label"]
        hparams = json.loads(row["hparams"] or "{}")
        acting = effective(row["method"], hparams)
        defaults, absent = get_method(row["method"]).hparams(), before(row["method"])
        if ran_with(row["resolved_hparams"], acting, absent) and all(defaults.get(k) != v for k, v in hparams.items()):
            return row["label"]  # as the grid named it
        ran = {**absent, **json.loads(row["resolved_hparams"])}
        differ = {k: ran.get(k, "unset") for k in acting if ran.get(k, "unset") != defaults.get(k)}
        text = ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in sorted(differ.items()))
        return row["method"] + (f"/{text}" if text else "")
    return table.assign(label=[label(row) for _, row in table.iterrows()])


UNRECORDED = ", ids unrecorded"  # ``calib``'s mark of the rows that record no tokenizer beside rows that do


def _protocol(table: pd.DataFrame) -> pd.DataFrame:
    """``eval_windows`` as an int (-1: the whole test split; 40 where a table lacks the column) and
    ``calib``, the calibration size ``nsamples×seqlen`` ("" where a table lacks it), its seed where it is
    not 0 and ``UNRECORDED`` where the row records no tokenizer digest while rows of its model and calibration
    size record one (``_unrecorded``): cells that differ in any are different measurements, never averaged
    together and never ranked against each other."""
    windows = table["eval_windows"] if "eval_windows" in table else pd.Series(40, index=table.index)
    seeds = table["seed"] if "seed" in table else pd.Series(0, index=table.index)
    calib = ([f"{n}×{s}" + (f" seed {int(seed)}" if int(seed or 0) else "")
              for n, s, seed in zip(table["nsamples"], table["seqlen"], seeds)]
             if {"nsamples", "seqlen"} <= set(table.columns) else "")
    return table.assign(eval_windows=pd.to_numeric(windows).astype(int), calib=_unrecorded(table, calib))


def _unrecorded(table: pd.DataFrame, calib: list[str] | str) -> list[str] | str:
    """``calib`` marked where a row records no tokenizer digest beside rows of the same model and calibration size
    that record one: its ids came from another split of the text (SmolLM2's rows of transformers' build of its GGUF
    tokenizer, results/README.md), so a partly remeasured grid never compares the two kinds of rows."""
    if "tokenizer" not in table or isinstance(calib, str):
        return calib
    recorded = table["tokenizer"].fillna("").astype(str).ne("")
    some = recorded.groupby([table["model"].to_numpy(), calib]).transform("any")
    return [c + UNRECORDED if others and not own else c for c, others, own in zip(calib, some, recorded)]


def headline(results_csv: str | Path, eval_seqlen: int | None = None) -> pd.DataFrame:
    """Perplexity per (model, calibration size, evaluation protocol, method) × sparsity, methods in the
    paper's order; the protocol is the window length and the number of test windows (-1: the whole split)."""
    table = load_rows(results_csv)
    if eval_seqlen is not None:
        table = table[table["eval_seqlen"] == eval_seqlen]
    wide = table.pivot_table(index=["model", "calib", "eval_seqlen", "eval_windows", "label"], columns="sparsity",
                             values="ppl")
    order = {label: i for i, label in enumerate(["dense", *_label_order(table["label"])])}
    return wide.sort_index(key=lambda idx: idx.map(order) if idx.name == "label" else idx)


# The paper's Table 5 rows, FASP as the one-shot reference; then the same rows with the Adam rate 1e-2 (the
# offline SmolLM2 setting), with the paper's update (every token in every round, full precision) and with the
# absolute Adam rate (``lr_scale``): rows keep the exact label of the settings they ran with (``exact_labels``).
ABSOLUTE_LR = "/lr=0.001,lr_scale=absolute"
PAPER_UPDATE = "sketch_tokens=0,update_precision=full"
UPDATE_LABELS = ("", "/lr=0.01", "/" + PAPER_UPDATE, ABSOLUTE_LR + "," + PAPER_UPDATE)
TABLE5 = ("fasp", "spap_no_update", *(m + u for u in UPDATE_LABELS for m in ("spap_gd", "spap")))


def table5(results_csv: str | Path) -> pd.DataFrame:
    """The paper's Table 5 from the grid's rows: per model, protocol (calibration size, evaluation) and
    sparsity where an ablation ran, perplexity of FASP and of SPAP with each part removed, and each one's
    increase over dense (%); last, the best composition with SPAP's alternating update in that cell, labelled
    with its parts. A cell not measured is empty; a protocol without a dense row, no percentages."""
    table = load_rows(results_csv)
    key = ["model", "calib", "eval_seqlen", "eval_windows"]
    dense = table[table["label"] == "dense"].groupby(["model", "eval_seqlen", "eval_windows"])["ppl"].first()
    cells = table[table["label"].isin(TABLE5)]
    wide = cells.pivot_table(index=[*key, "sparsity"], columns="label", values="ppl")
    wide = wide[[label for label in TABLE5 if label in wide.columns]]
    ablations = [label for label in TABLE5 if label.startswith(("spap_no_update", "spap_gd")) and label in wide.columns]
    wide = wide[wide[ablations].notna().any(axis=1)]  # cells where an ablation ran (the rest is the sweep)
    # the best composition with the alternating update in each cell (any label: the parts table's), its own column
    pruned = table[table["label"] != "dense"]
    alternating = pruned[_part_of(pruned, "update") == "alternating"]
    best = alternating.loc[alternating.groupby([*key, "sparsity"])["ppl"].idxmin()].set_index([*key, "sparsity"])
    out = pd.DataFrame(index=wide.index)
    for (model, _, seqlen, windows, _), row in wide.iterrows():
        base = dense.get((model, seqlen, windows))
        out.loc[row.name, "dense"] = "" if base is None else f"{base:.2f}"

        def cell(ppl):
            return "" if pd.isna(ppl) else f"{ppl:.2f}" + ("" if base is None else f" (+{100 * (ppl / base - 1):.1f}%)")
        for label, ppl in row.items():
            out.loc[row.name, label] = cell(ppl)
        top = best.loc[row.name] if row.name in best.index else None
        out.loc[row.name, "best composition"] = "" if top is None else f"{cell(top['ppl'])}: {top['label']}"
    return out.reset_index()


PARTS = ("select", "allocation", "update")


def label_parts(label: str) -> dict[str, str]:
    """A label's three parts (``Method.parts``: channel selection, allocation, update) and the other settings it
    names; a whole-model method (SliceGPT) has no parts. A label relabelled with a setting that no longer
    parses (``option=unset``) keeps its method's parts."""
    from spap_lib.errors import ParameterError
    from spap_lib.methods import get_method
    from spap_lib.methods.base import parse_label

    name, hparams = parse_label(label)
    try:
        parts = get_method(label).parts()
    except (ParameterError, ValueError):
        parts = get_method(name, **{k: v for k, v in hparams.items() if k in PARTS}).parts()
    others = ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}"
                      for k, v in hparams.items() if k not in PARTS)
    return {**{k: parts.get(k, "") for k in PARTS}, "settings": others}


def _part_of(table: pd.DataFrame, part: str) -> pd.Series:
    """Each row's ``part`` (or ``"settings"``) from its label (``label_parts``, read once per label)."""
    parts = {label: label_parts(label)[part] for label in set(table["label"])}
    return table["label"].map(parts)


def compositions(results_csv: str | Path) -> pd.DataFrame:
    """What each part contributes: per model and protocol (calibration size, evaluation), every labelled method
    with its channel selection, allocation and update (``Method.parts``: the baselines are compositions too),
    the other settings its label names, and its perplexity per sparsity; sorted by the parts, so rows that
    differ in one part sit together."""
    table = load_rows(results_csv)
    table = table[table["label"] != "dense"]
    key = ["model", "calib", "eval_seqlen", "eval_windows"]
    wide = table.pivot_table(index=[*key, "label"], columns="sparsity", values="ppl").reset_index()
    if not len(wide):  # a table of dense rows only
        return pd.DataFrame(columns=[*key, *PARTS, "settings", "label"])
    parts = pd.DataFrame([label_parts(label) for label in wide["label"]], index=wide.index)
    wide = pd.concat([wide[key], parts, wide.drop(columns=key)], axis=1)
    wide = wide[wide["select"] != ""]  # whole-model methods have no parts to compare
    return wide.sort_values([*key, *PARTS, "settings"], kind="stable").reset_index(drop=True)


def best_compositions(results_csv: str | Path) -> pd.DataFrame:
    """Per model, protocol and sparsity: the best baseline (a method not the paper's, at its own parts), the best
    composition that includes SPAP's alternating update, and the best of those at uniform widths (stock-loadable
    checkpoints); ``lead`` is the best baseline's perplexity minus the best composition's (positive: the
    composition leads)."""
    from spap_lib.methods.base import parse_label

    columns = ["model", "calib", "eval_seqlen", "eval_windows", "sparsity", "best baseline", "baseline ppl",
               "best with alternating update", "ppl", "lead", "best uniform-width", "uniform ppl"]
    table = load_rows(results_csv)
    table = table[table["label"] != "dense"]
    if not len(table):  # no pruned cell: the columns still, for the renderers
        return pd.DataFrame(columns=columns)
    alternating = _part_of(table, "update") == "alternating"
    uniform = _part_of(table, "allocation").isin(("uniform", ""))
    baseline = table["label"].map(lambda lab: not is_ours(parse_label(lab)[0])) & ~alternating
    rows = []
    for key, cell in table.groupby(["model", "calib", "eval_seqlen", "eval_windows", "sparsity"], sort=True):
        def best(mask):
            pick = cell[mask.loc[cell.index]]
            return ("", float("nan")) if not len(pick) else \
                tuple(pick.loc[pick["ppl"].idxmin(), ["label", "ppl"]])
        (b_label, b_ppl), (a_label, a_ppl) = best(baseline), best(alternating)
        u_label, u_ppl = best(alternating & uniform)
        if a_label and b_label:
            rows.append({**dict(zip(["model", "calib", "eval_seqlen", "eval_windows", "sparsity"], key)),
                         "best baseline": b_label, "baseline ppl": b_ppl, "best with alternating update": a_label,
                         "ppl": a_ppl, "lead": b_ppl - a_ppl, "best uniform-width": u_label, "uniform ppl": u_ppl})
    return pd.DataFrame(rows, columns=columns)


def layer_plot(report: dict, title: str):
    """02's per-layer picture of one prune report: the relative MLP error on calibration where the method
    records it (SPAP: after the penalty method's refit and after the alternating update), otherwise what
    each layer gave up (MLP channels removed; SliceGPT: the residual dimension each block keeps)."""
    import matplotlib.pyplot as plt

    layers = pd.DataFrame(report["layers"])
    fig, ax = plt.subplots(figsize=(7, 2.8))
    errors = {"rel_error_penalty": "after penalty method + refit", "rel_error_final": "after alternating update"}
    drawn = [col for col in errors if col in layers]
    if drawn:
        for col in drawn:
            ax.plot(layers["layer"], layers[col], marker="o", ms=3, label=errors[col])
        ax.set(ylabel="relative MLP error on calibration", yscale="log")
        ax.legend()
    elif "removed" in layers:  # score methods and FASP: the per-layer allocation
        ax.bar(layers["layer"], layers["removed"], color="0.5")
        ax.set(ylabel="MLP channels removed")
    else:  # SliceGPT: {"in", "mid", "out"} per block
        ax.plot(range(len(layers)), layers["mid"], marker="o", ms=3, color="0.3")
        ax.set(ylabel="kept residual dimension", ylim=(0, None))
    ax.set(xlabel="decoder layer", title=title)
    fig.tight_layout()
    return fig


# The paper's models closest to the offline ones: the same architecture (Qwen2.5-Coder-0.5B is the
# Qwen2.5-0.5B architecture) or the same family (SmolLM2 is a Llama-architecture model; the paper's
# smallest Llama is 3.2-1B). Other checkpoints, other protocols: the percentages compare, the values do not.
PAPER_TWINS = {"qwen2.5-coder-0.5b": "qwen2.5-0.5b", "smollm2-135m": "llama-3.2-1b"}
PAPER_PROTOCOL = "128 calibration windows (length not stated; its peers use 2048), whole WikiText-2 test split"


def beside_paper(results_csv: str | Path, paper_csv: str | Path, calib: str, eval_windows: int = 40) -> pd.DataFrame:
    """Our perplexity at one calibration size beside the paper's on its closest model, per method (each at
    its default settings, the label equal to the method) and sparsity, each with its increase over its
    own dense model: ``ours`` and ``paper`` columns per sparsity. Methods the paper did not run are blank."""
    ours = load_rows(results_csv)
    ours = ours[(ours["eval_windows"] == eval_windows) & ours["model"].isin(PAPER_TWINS)
                & ((ours["calib"] == calib) | (ours["label"] == "dense")) & (ours["label"] == ours["method"])]
    paper = pd.read_csv(paper_csv)
    paper = paper[paper["table"].isin(["table2", "table5"]) & (paper["metric"] == "wikitext2_ppl")]
    rows, sparsities = [], sorted({s for s in ours["sparsity"] if s > 0})  # every model's columns, in order
    for model, twin in PAPER_TWINS.items():
        mine = ours[ours["model"] == model]
        theirs = paper[paper["model"] == twin]
        if (mine["label"] == "dense").all():  # no pruned cell at this calibration size
            continue
        dense = {"ours": _first(mine[mine["label"] == "dense"]["ppl"]),
                 "paper": _first(theirs[theirs["method"] == "dense"]["value"])}
        for method in ["dense", *_label_order(set(mine["label"]) & set(method_order()))]:
            row = {"model": model, "paper's model": twin, "method": method}
            for sparsity in sparsities:
                for who, part, col in (("ours", mine[mine["label"] == method], "ppl"),
                                       ("paper", theirs[theirs["method"] == method], "value")):
                    ppl = _first(part[part["sparsity"] == (0 if method == "dense" else sparsity)][col])
                    base = dense[who]
                    row[f"{sparsity:.0%} {who}"] = "" if ppl is None else f"{ppl:.2f}" + (
                        "" if method == "dense" or base is None else f" (+{100 * (ppl / base - 1):.1f}%)")
            rows.append(row)
    return pd.DataFrame(rows)


def _first(values: pd.Series) -> float | None:
    values = pd.to_numeric(values, errors="coerce").dropna()
    return float(values.iloc[0]) if len(values) else None


_UNESCAPED_PIPE = re.compile(r"(?<!\\)\|")


def markdown_table(frame: pd.DataFrame, **to_markdown) -> str:
    """``frame.to_markdown(**to_markdown)`` with every unescaped ``|`` in its labels and text cells escaped.

    GitHub ends a table cell at each unescaped pipe, inside code spans too, so a label such as
    ``Σᵢ|W_ij|`` or a column named ``max |diff|`` would shift the rest of its row. A pipe already escaped
    is kept as it is, not escaped twice."""
    def escape(value):
        return _UNESCAPED_PIPE.sub(r"\\|", value) if isinstance(value, str) else value

    out = frame.rename(columns=escape, index=escape)
    for i, dtype in enumerate(out.dtypes):
        if pd.api.types.is_string_dtype(dtype):  # object or str columns; numbers keep their formatting
            out.iloc[:, i] = out.iloc[:, i].map(escape)
    return out.to_markdown(**to_markdown)
