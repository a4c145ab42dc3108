"""The llama.cpp tables (``results/llamacpp.csv`` and ``results/llamacpp_round_to.csv``, written by
``bench/engines.py``): their schema and check, the block the docs render from one, and its figure, drawn from the
table alone.

    python -m spap_lib.artifact.engines results/llamacpp.csv figures/llamacpp_speed.png   # `make figures`
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import pandas as pd

from spap_lib.errors import SourceError
from spap_lib.files import atomic_file

COLUMNS = ["model", "label", "method", "sparsity", "round_to", "achieved_sparsity", "mlp_width", "quant", "file_mb",
           "eval_seqlen", "eval_windows", "ppl_llamacpp", "ppl_transformers", "greedy_agreement", "prompt_tps",
           "decode_tps", "prompt_ratio", "decode_ratio", "bytes_bound", "threads", "repeats", "repack", "engine",
           "engine_version", "cpu"]
_POSITIVE = ["file_mb", "ppl_llamacpp", "ppl_transformers", "prompt_tps", "decode_tps", "prompt_ratio",
             "decode_ratio", "bytes_bound"]
QUANT_COLOURS = {"f16": "#1f77b4", "q8_0": "#2ca02c", "q4_k_m": "#d62728"}


def check_table(path: str | Path) -> pd.DataFrame:
    """The table, after refusing in one line what no run of ``bench/engines.py`` writes: missing columns, no rows,
    a value that is not a positive finite number, a cell twice, a quantization without its dense row."""
    path = Path(path)
    try:
        table = pd.read_csv(path)
    except (OSError, ValueError) as err:
        raise SourceError(f"{path}: not a readable table ({err}); rerun `make engines`") from None
    missing = [c for c in COLUMNS if c not in table]
    if missing or not len(table):
        raise SourceError(f"{path}: {'columns ' + ', '.join(missing) + ' missing' if missing else 'no rows'}; "
                          "rerun `make engines`")
    for column in _POSITIVE:
        values = pd.to_numeric(table[column], errors="coerce")
        bad = [i for i, v in enumerate(values) if not (math.isfinite(v) and v > 0)]
        if bad:
            value = str(table[column].iloc[bad[0]])
            raise SourceError(f"{path}, row {bad[0] + 2}: {column} is {value!r}, not a positive number; "
                              "rerun `make engines`")
    twice = table.duplicated(["model", "label", "quant"])
    if twice.any():
        row = table[twice].iloc[0]
        raise SourceError(f"{path}: {row['model']} {row['label']} {row['quant']} appears twice; rerun `make engines`")
    for (model, quant), part in table.groupby(["model", "quant"]):
        if "dense" not in set(part["label"]):
            raise SourceError(f"{path}: {model} at {quant} has no dense row to compare with; rerun `make engines`")
    return table


def with_model(path: str | Path, rows: pd.DataFrame) -> pd.DataFrame:
    """The table at ``path`` with its rows of ``rows``' model replaced by ``rows``: a table holds one run per model
    (each model's ratios are to its own dense file, timed in the same run), so other models' rows are kept."""
    path = Path(path)
    if not path.is_file():
        return rows
    kept = check_table(path)
    kept = kept[~kept["model"].isin(set(rows["model"]))]
    return pd.concat([kept, rows], ignore_index=True) if len(kept) else rows


def render(path: str | Path) -> str:
    """The docs' block: per checkpoint and quantization, size, quality and speed beside dense."""
    from spap_lib.artifact.figures import markdown_table

    table = check_table(path)
    shown = pd.DataFrame({
        "model": table["model"], "checkpoint": table["label"], "MLP width": table["mlp_width"].astype(int),
        "removed": [f"{x:.1%}" for x in table["achieved_sparsity"]], "quant": table["quant"],
        "MB": table["file_mb"].round(1), "ppl llama.cpp": table["ppl_llamacpp"].round(3),
        "ppl transformers": table["ppl_transformers"].round(3),
        "greedy agree": [f"{x:.0%}" for x in table["greedy_agreement"]],
        "prompt tok/s": table["prompt_tps"].round(0).astype(int),
        "prompt × dense": table["prompt_ratio"].round(2), "decode tok/s": table["decode_tps"].round(1),
        "decode × dense": table["decode_ratio"].round(2), "bytes bound": table["bytes_bound"].round(2)})
    notes = []
    for model, rows in table.groupby("model", sort=False):  # each model's run, in one line
        first = rows.iloc[0]
        notes.append((f"{model}: " if table["model"].nunique() > 1 else "") +
                     f"{first['engine']} {first['engine_version']}, {int(first['threads'])} threads, {first['cpu']}, "
                     f"weights {'repacked' if first['repack'] else 'not repacked'} (docs/scale.md: llama.cpp); "
                     f"medians of {int(first['repeats'])} interleaved repeats; perplexity on the first "
                     f"{int(first['eval_windows'])} test windows of {int(first['eval_seqlen'])}.")
    return markdown_table(shown, index=False, disable_numparse=True) + "\n\n" + "\n".join(notes)


def figure(path: str | Path, out: str | Path):
    """Decode speed-up over dense against the share of parameters removed, one line per quantization and one
    panel per rounding of the widths; the bytes bound (dense file size over the pruned file's) dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = check_table(path)
    roundings = sorted(table.loc[table["label"] != "dense", "round_to"].unique()) or [0]
    fig, axes = plt.subplots(1, len(roundings), figsize=(5.5 * len(roundings), 4.2), squeeze=False, sharey=True)
    for ax, round_to in zip(axes[0], roundings):
        part = table[(table["label"] == "dense") | (table["round_to"] == round_to)]
        for quant, rows in part.groupby("quant", sort=False):
            rows = rows.sort_values("achieved_sparsity")
            colour = QUANT_COLOURS.get(quant)
            x = rows["achieved_sparsity"] * 100
            ax.plot(x, rows["decode_ratio"], marker="o", color=colour, label=f"{quant} measured")
            ax.plot(x, rows["bytes_bound"], linestyle="--", color=colour, alpha=0.7, label=f"{quant} bytes bound")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_title(f"{table['model'].iloc[0]}, widths {'as pruned' if not round_to else f'rounded to {round_to}'}")
        ax.set_xlabel("decoder parameters removed (%)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"decode tokens/s over dense ({int(table['threads'].iloc[0])} threads, llama.cpp)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    with atomic_file(out) as tmp:
        fig.savefig(tmp, dpi=120, format=Path(out).suffix.lstrip(".") or "png")
    plt.close(fig)
    return fig


if __name__ == "__main__":
    figure(*sys.argv[1:3])
