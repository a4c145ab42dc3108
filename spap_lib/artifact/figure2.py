"""The paper's Figure 2 from the results table alone: perplexity against the parameters removed, one panel per
model and calibration budget, the paper's methods in fixed colours and markers, SPAP emphasised, and the best
composition of the three parts as one more named line. Every other composition is a table
(docs/results/compositions.md), not a line.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from spap_lib.artifact.figures import ablation_of, label_parts, load_rows, method_order
from spap_lib.errors import ParameterError
from spap_lib.files import atomic_file

# The paper's methods as every panel draws them: (name in the legend, colour, marker).
STYLE = {
    "magnitude": ("Magnitude", "#7f7f7f", "v"),
    "wanda_sp": ("Wanda-SP", "#9467bd", "D"),
    "flap": ("FLAP", "#2ca02c", "s"),
    "cfsp": ("CFSP", "#ff7f0e", "^"),
    "slicegpt": ("SliceGPT", "#8c564b", "X"),
    "fasp": ("FASP", "#1f77b4", "P"),
    "spap": ("SPAP", "#d62728", "o"),
}
OURS = "spap"
OTHER = ("#17becf", "h")  # a registered method the paper does not draw
# How a label's settings read in a legend: a part by what it chooses, the paper's update by name.
PAPER_UPDATE = {"lr": 0.001, "lr_scale": "absolute", "sketch_tokens": 0, "update_precision": "full"}


def readable(label: str) -> str:
    """A label as a person reads it: ``spap/select=act_norm,allocation=angular`` → "SPAP, act-norm channels,
    angular widths"; ``flap/bias=false`` → "FLAP, bias=false"; the paper's update settings → "the paper's update"."""
    from spap_lib.methods.base import parse_label

    method, hparams = parse_label(label)
    words = [STYLE.get(method, (method,))[0]]
    if PAPER_UPDATE.items() <= hparams.items():
        words.append("the paper's update")
        hparams = {k: v for k, v in hparams.items() if k not in PAPER_UPDATE}
    for key, value in hparams.items():
        text = str(value).lower() if isinstance(value, bool) else str(value)
        words.append({"select": f"{text.replace('_', '-')} channels", "allocation": f"{text} widths",
                      "update": f"{text} update", "allocation_precision": f"{text} widths pass",
                      "concentrated": f"concentration guard {text}"}.get(key, f"{key}={text}"))
    return ", ".join(words)


def _own_labels(pruned: pd.DataFrame) -> dict[str, str]:
    """Each method at its own parts: its most-measured label in the panel, the bare name on a tie (a bare row
    at one sparsity does not replace a sweep); ablations are Table 5's, not lines here."""
    from spap_lib.methods import METHODS
    from spap_lib.methods.base import parse_label

    own = {}
    for method, rows in pruned.groupby(pruned["label"].map(lambda lab: parse_label(lab)[0]), sort=False):
        if method in METHODS and not ablation_of(method):
            counts = rows["label"].value_counts()
            own[method] = max(counts.index, key=lambda label: (counts[label], label == method))
    return own


def best_composition(pruned: pd.DataFrame, ours: str | None) -> str | None:
    """The composition with SPAP's alternating update whose parts differ from SPAP's own line and whose
    perplexity, relative to that line at the same sparsities, is lowest on average; measured at two sparsities
    at least (or at all of SPAP's, if fewer). None if there is no such composition or no SPAP line."""
    if ours is None:
        return None
    spap = pruned[pruned["label"] == ours].groupby("sparsity")["ppl"].mean()
    own_parts = {k: v for k, v in label_parts(ours).items() if k != "settings"}
    best, score = None, float("inf")
    for label, rows in pruned.groupby("label", sort=True):
        parts = label_parts(label)
        if parts["update"] != "alternating" or {k: parts[k] for k in own_parts} == own_parts:
            continue
        ratio = (rows.groupby("sparsity")["ppl"].mean() / spap).dropna()
        if len(ratio) >= min(2, len(spap)) and ratio.mean() < score:
            best, score = label, float(ratio.mean())
    return best


def _panels(table: pd.DataFrame, min_cells: int) -> list[tuple[str, str]]:
    """(model, calibration) panels with at least ``min_cells`` pruned cells: budgets are never mixed. A table
    where no panel has that many (a few methods at one sparsity) draws every panel it has."""
    pruned_cells = table[table["label"] != "dense"].groupby(["model", "calib"], sort=False).size()
    return [key for key, count in pruned_cells.items() if count >= min_cells] or list(pruned_cells.index)


def _draw_panel(ax, part: pd.DataFrame, eval_seqlen: int, ymax: float | None) -> None:
    """One model and budget: the methods' own lines in the paper's style, SPAP on top, its best composition
    dashed beside it, the dense model as a horizontal line; its own legend (the composition is the panel's)."""
    pruned = part[part["label"] != "dense"]
    x = "achieved_sparsity" if "achieved_sparsity" in pruned and (pruned["achieved_sparsity"] != "").all() \
        else "sparsity"  # the decoder parameters each cell removed (SliceGPT's slicing fraction is not that)
    pruned = pruned.assign(**{x: pd.to_numeric(pruned[x])})
    own = _own_labels(pruned)
    lines = [(method, own[method]) for method in method_order() if method in own]
    composition = best_composition(pruned, own.get(OURS))
    for method, label in lines + ([("composition", composition)] if composition else []):
        rows = pruned[pruned["label"] == label].groupby("sparsity", as_index=False)[[x, "ppl"]].mean()
        name, color, marker = STYLE.get(method, (None, *OTHER))
        mine = method in (OURS, "composition")
        if method == "composition":
            name, color, marker = readable(label), STYLE[OURS][1], "*"
        elif label != method:
            name = readable(label)
        ax.plot(rows[x], rows["ppl"], color=color, marker=marker, ls="--" if method == "composition" else "-",
                lw=2.4 if mine else 1.3, ms=8 if mine else 5, zorder=3 if mine else 2, label=name)
    dense = part[part["label"] == "dense"]["ppl"]
    if len(dense):
        ax.axhline(float(dense.iloc[0]), color="k", ls=":", lw=1, label="dense")
        ax.set_ylim(bottom=float(dense.iloc[0]) * 0.9)
    ax.set_yscale("log")
    readable_ppl = pruned["ppl"][pruned["ppl"] < 1e3]  # collapsed runs (ppl >= 1000) go off the top
    top = ymax or (float(readable_ppl.max()) * 1.1 if len(readable_ppl) else None)
    if top:
        ax.set_ylim(top=top)
    ticks = sorted(set(pruned["sparsity"]))
    ax.set_xticks(ticks, [f"{t:.0%}" for t in ticks])
    ax.set_xlabel("decoder-layer parameters removed" + (" (measured)" if x == "achieved_sparsity" else ""))
    windows = int(part["eval_windows"].iloc[0])
    ax.set_ylabel(f"WikiText-2 perplexity @ {eval_seqlen}, {'whole test' if windows < 0 else f'{windows} windows'}")
    ax.legend(fontsize=7, loc="upper left", frameon=True)


def figure2(results_csv: str | Path, out: str | Path, eval_seqlen: int | None = None, ymax: float | None = None,
            min_cells: int = 6):
    """The paper's Figure 2 (see the module's docstring). One protocol per panel: the test-window count most of
    the model's cells used (a few headline cells scored on the whole split stay out of the grid's curves). The
    dense model is the dotted line; ``ymax`` clips collapsed baselines. Written atomically; returns the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = load_rows(results_csv)
    if eval_seqlen is None:
        eval_seqlen = int(table["eval_seqlen"].mode().iloc[0])
    table = table[table["eval_seqlen"] == eval_seqlen]
    table = pd.concat([part[part["eval_windows"] == part["eval_windows"].mode().iloc[0]]
                       for _, part in table.groupby("model", sort=False)])
    panels = _panels(table, min_cells)
    if not panels:
        raise ParameterError(f"{results_csv} has no pruned cell at eval_seqlen {eval_seqlen}: nothing to draw; "
                             "run 03_ablate with prune=True first")
    cols = min(len(panels), 2)
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.5 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.remove()
    for ax, (model, calib) in zip(axes.flat, panels):
        part = table[(table["model"] == model) & ((table["calib"] == calib) | (table["label"] == "dense"))]
        _draw_panel(ax, part, eval_seqlen, ymax)
        ax.set_title(f"{model}" + (f" (calibration {calib})" if calib else ""))
    fig.tight_layout()
    out = Path(out)
    with atomic_file(out) as tmp:
        fig.savefig(tmp, dpi=150, format=out.suffix.lstrip(".") or "png", bbox_inches="tight")
    return fig
