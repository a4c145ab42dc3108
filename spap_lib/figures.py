"""Figures and tables drawn only from result tables (CSV), so they regenerate without pruning."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from . import io

def method_order() -> list[str]:
    """Every registered method in the paper's order, from what the method classes declare: one-shot score
    baselines, then the propagating baseline (FASP), then ablations, then the paper's method (each group
    in registration order)."""
    from .methods import METHODS

    def group(name: str) -> int:
        m = METHODS[name]
        return 3 if m.ours and not m.ablation_of else 2 if m.ours else 1 if m.propagates else 0
    return sorted(METHODS, key=group)


def _label_order(labels) -> list[str]:
    order = method_order()

    def rank(label: str):
        method = label.split("/")[0]
        return (order.index(method) if method in order else len(order), label)
    return sorted(set(labels) - {"dense"}, key=rank)


def figure2(results_csv: str | Path, out: str | Path, eval_seqlen: int | None = None, ymax: float | None = None):
    """The paper's Figure 2: WikiText-2 perplexity vs sparsity per method, one panel per model.

    The dense model is the horizontal dashed line; ``ymax`` clips collapsed baselines (magnitude)
    so the methods that matter stay readable. Written atomically; returns the figure.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    table = _protocol(pd.read_csv(results_csv, keep_default_na=False))
    if eval_seqlen is None:
        eval_seqlen = int(table["eval_seqlen"].mode().iloc[0])
    table = table[table["eval_seqlen"] == eval_seqlen]
    # One protocol per panel: the calibration size and test-window count most of the model's cells used
    # (the whole-split rows of a few headline cells, or a calibration-size study, would otherwise be
    # mixed into the grid's curves).
    table = pd.concat([part[(part["eval_windows"] == part["eval_windows"].mode().iloc[0])
                            & (part["calib"] == part["calib"].mode().iloc[0])]
                       for _, part in table.groupby("model", sort=False)])
    models = list(dict.fromkeys(table["model"]))
    sns.set_theme(style="whitegrid", context="notebook")
    labels = _label_order(table["label"])
    palette = dict(zip(labels, sns.color_palette("tab10" if len(labels) <= 10 else "tab20", len(labels))))
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models) + 2.5, 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        part = table[table["model"] == model]
        pruned = part[part["label"] != "dense"]
        present = [lab for lab in labels if lab in set(pruned["label"])]
        # x: the decoder parameters each cell actually removed (SliceGPT's slicing fraction is not that)
        x = "achieved_sparsity" if "achieved_sparsity" in pruned and (pruned["achieved_sparsity"] != "").all() \
            else "sparsity"
        pruned = pruned.assign(**{x: pd.to_numeric(pruned[x])})
        sns.lineplot(data=pruned, x=x, y="ppl", hue="label", style="label", markers=True, dashes=False,
                     hue_order=present, style_order=present, palette=palette, ax=ax, legend="brief")
        dense = part[part["label"] == "dense"]["ppl"]
        if len(dense):
            ax.axhline(float(dense.iloc[0]), color="k", ls="--", lw=1, label="dense")
            ax.set_ylim(bottom=float(dense.iloc[0]) * 0.9)
        ax.set_yscale("log")
        readable = pruned["ppl"][pruned["ppl"] < 1e3]  # collapsed runs (ppl >= 1000) go off the top
        top = ymax or (float(readable.max()) * 1.1 if len(readable) else None)
        if top:
            ax.set_ylim(top=top)
        ticks = sorted(set(pruned["sparsity"]))
        ax.set_xticks(ticks, [f"{t:.0%}" for t in ticks])
        ax.set_xlabel("decoder-layer parameters removed" + (" (measured)" if x == "achieved_sparsity" else ""))
        windows, calib = int(part["eval_windows"].iloc[0]), part["calib"].iloc[0]
        ax.set_ylabel(f"WikiText-2 perplexity @ {eval_seqlen}, {'whole test' if windows < 0 else f'{windows} windows'} (log)")
        ax.set_title(f"{model}" + (f" (calibration {calib})" if calib else ""))
        handles, names = ax.get_legend_handles_labels()
        ax.legend(handles, names, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    fig.tight_layout()
    out = Path(out)
    with io.atomic_file(out) as tmp:
        fig.savefig(tmp, dpi=150, format=out.suffix.lstrip(".") or "png")
    return fig


def _protocol(table: pd.DataFrame) -> pd.DataFrame:
    """``eval_windows`` as an int (-1: the whole test split; 40 where a table lacks the column) and
    ``calib``, the calibration size ``nsamples×seqlen`` ("" where a table lacks it): cells that differ
    in either are different measurements and never averaged together."""
    windows = table["eval_windows"] if "eval_windows" in table else pd.Series(40, index=table.index)
    calib = ([f"{n}×{s}" for n, s in zip(table["nsamples"], table["seqlen"])]
             if {"nsamples", "seqlen"} <= set(table.columns) else "")
    return table.assign(eval_windows=pd.to_numeric(windows).astype(int), calib=calib)


def headline(results_csv: str | Path, eval_seqlen: int | None = None) -> pd.DataFrame:
    """Perplexity per (model, calibration size, evaluation protocol, method) × sparsity, methods in the
    paper's order; the protocol is the window length and the number of test windows (-1: the whole split)."""
    table = _protocol(pd.read_csv(results_csv, keep_default_na=False))
    if eval_seqlen is not None:
        table = table[table["eval_seqlen"] == eval_seqlen]
    wide = table.pivot_table(index=["model", "calib", "eval_seqlen", "eval_windows", "label"], columns="sparsity",
                             values="ppl")
    order = {label: i for i, label in enumerate(["dense", *_label_order(table["label"])])}
    return wide.sort_index(key=lambda idx: idx.map(order) if idx.name == "label" else idx)


# The paper's Table 5 rows, FASP as the one-shot reference; then the same rows with the paper's update (every
# token in every round, full precision) and with the absolute Adam rate (``lr_scale``): rows keep the exact
# label of the settings they ran with.
ABSOLUTE_LR = "/lr=0.001,lr_scale=absolute"
PAPER_UPDATE = "sketch_tokens=0,update_precision=full"
UPDATES = ("", "/" + PAPER_UPDATE, ABSOLUTE_LR + "," + PAPER_UPDATE)
TABLE5 = ("fasp", "spap_no_update", *(m + u for u in UPDATES for m in ("spap_gd", "spap")))


def table5(results_csv: str | Path) -> pd.DataFrame:
    """The paper's Table 5 from the grid's rows: per model, protocol (calibration size, evaluation) and
    sparsity where an ablation ran, perplexity of FASP and of SPAP with each part removed, and each one's
    increase over dense (%). A cell not measured is empty; a protocol without a dense row, no percentages."""
    table = _protocol(pd.read_csv(results_csv, keep_default_na=False))
    key = ["model", "calib", "eval_seqlen", "eval_windows"]
    dense = table[table["label"] == "dense"].groupby(["model", "eval_seqlen", "eval_windows"])["ppl"].first()
    cells = table[table["label"].isin(TABLE5)]
    wide = cells.pivot_table(index=[*key, "sparsity"], columns="label", values="ppl")
    wide = wide[[label for label in TABLE5 if label in wide.columns]]
    ablations = [label for label in TABLE5 if label.startswith(("spap_no_update", "spap_gd")) and label in wide.columns]
    wide = wide[wide[ablations].notna().any(axis=1)]  # cells where an ablation ran (the rest is the sweep)
    out = pd.DataFrame(index=wide.index)
    for (model, _, seqlen, windows, _), row in wide.iterrows():
        base = dense.get((model, seqlen, windows))
        out.loc[row.name, "dense"] = "" if base is None else f"{base:.2f}"
        for label, ppl in row.items():
            out.loc[row.name, label] = "" if pd.isna(ppl) else \
                f"{ppl:.2f}" + ("" if base is None else f" (+{100 * (ppl / base - 1):.1f}%)")
    return out.reset_index()


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
