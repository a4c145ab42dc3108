"""Render committed result tables into README.md and docs/*.md (between their markers).

    python -m spap_lib.artifact.render results/ablation.csv           # 03_ablate    (ablation:start/end, the
                                                                      #   SPAP sweep: results, Table 5: table5,
                                                                      #   beside the paper: paper, the 128 x 512
                                                                      #   grid: budget128)
    python -m spap_lib.artifact.render results/zeroshot.csv           # 04_evaluate  (zeroshot:start/end)
    python -m spap_lib.artifact.render results/profile.csv            # 05_profile   (profile:start/end)
    python -m spap_lib.artifact.render results/profile_slicegpt.csv   # 05, SliceGPT (profile_slicegpt:start/end)
    python -m spap_lib.artifact.render results/llamacpp.csv           # bench/engines.py (llamacpp:start/end)
    python -m spap_lib.artifact.render results/llamacpp_round_to.csv  # make engines-round-to (llamacpp_round_to)
    python -m spap_lib.artifact.render results/tokenizer_split.csv    # SmolLM2's own split (tokenizer_split)
    python -m spap_lib.artifact.render --check results/ablation.csv   # exit 1 if README's blocks are stale
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pandas as pd

from spap_lib.artifact import engines
from spap_lib.artifact.figures import UPDATE_LABELS, load_rows, markdown_table
from spap_lib.files import REPO, write_text_atomic

DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]  # where rendered blocks may live
PAPER_CSV = REPO / "results" / "paper_tables.csv"


def render_sweep(csv: str) -> str:
    """SPAP per model and sparsity, from the ablation grid's rows (one sweep implementation: the grid):
    perplexity per evaluation protocol, the budget actually removed, and the pruning time."""
    df = load_rows(csv)
    df = df[df["label"].isin(["dense", *("spap" + u for u in UPDATE_LABELS)])]
    df = df.assign(eval=[f"ppl @ {s} × {'whole test' if int(w) < 0 else f'first {int(w)}'}"
                         for s, w in zip(df["eval_seqlen"], df["eval_windows"])])
    cell = ["model", "calib", "label", "sparsity"]
    ppl = df.pivot_table(index=cell, columns="eval", values="ppl")
    first = df.drop_duplicates(cell).set_index(cell)
    if "resumed_at_layer" not in first:  # a table written before the column
        first = first.assign(resumed_at_layer=0)
    extra = ["achieved_sparsity", "mlp_channel_ratio", "prune_seconds", "device", "resumed_at_layer"]
    table = ppl.join(first[extra]).reset_index().rename(columns={"label": "method"})
    digits = {**{c: 2 for c in ppl.columns}, "achieved_sparsity": 4, "mlp_channel_ratio": 4, "prune_seconds": 0}
    table = table.round(digits).astype(object)
    # A resumed cell's time is of the layers its last process pruned: say so next to the number.
    resumed = pd.to_numeric(table.pop("resumed_at_layer"), errors="coerce").fillna(0)
    table["prune_seconds"] = [f"{t:.0f}" + (f" (layers {int(k)}+)" if k > 0 else "")
                              for t, k in zip(table["prune_seconds"], resumed)]
    return markdown_table(table.where(table.notna(), ""), index=False)


def render_ablation(csv: str) -> str:
    """Perplexity per model/protocol/method (rows) and sparsity (columns), methods in the paper's order;
    the protocol column says the window length and how many test windows were scored."""
    from spap_lib.artifact.figures import headline

    wide = headline(csv).round(2).reset_index()
    wide.insert(2, "eval", [f"{s} × {'whole test' if w < 0 else f'first {w}'}"
                            for s, w in zip(wide.pop("eval_seqlen"), wide.pop("eval_windows"))])
    wide.columns = [c if isinstance(c, str) else f"{c:.0%}" for c in wide.columns]
    wide = wide.rename(columns={"0%": "dense"})
    keys = wide.columns.get_loc("label") + 1  # model, calib, eval, label; then a perplexity per sparsity
    for c in wide.columns[keys:]:  # every perplexity with two decimals (32.90, not 32.9)
        wide[c] = ["" if pd.isna(v) else f"{v:.2f}" for v in wide[c]]
    align = ("left",) * keys + ("right",) * (len(wide.columns) - keys)
    return markdown_table(wide, index=False, disable_numparse=True, colalign=align)


def render_table5(csv: str) -> str:
    """Table 5 (does each part of SPAP help?) per model and protocol, with the increase over dense."""
    from spap_lib.artifact.figures import table5

    table = table5(csv)
    table.insert(2, "eval", [f"{s} × {'whole test' if w < 0 else f'first {w}'}"
                             for s, w in zip(table.pop("eval_seqlen"), table.pop("eval_windows"))])
    table["sparsity"] = [f"{x:.0%}" for x in table["sparsity"]]
    return markdown_table(table, index=False)


def render_zeroshot(csv: str) -> str:
    """Table 3: perplexities, then accuracy (%) ± lm-eval's standard error per task with the metric the
    paper reports, and the mean; one row per checkpoint and number of examples scored per task."""
    from spap_lib.evaluation.zeroshot import table3

    table = table3(pd.read_csv(csv), stderr=True).reset_index()
    table["limit"] = ["all" if x < 0 else str(int(x)) for x in table["limit"]]
    table = table.rename(columns={"limit": "examples"}).rename(columns=lambda c: c.replace("ppl@", "ppl @ "))
    table = table.astype(object).where(table.notna(), "")  # a protocol a run did not score is blank, not nan
    return ("(accuracy in %, ± lm-eval's standard error; `examples`: per task, `all` = the whole split)\n\n"
            + markdown_table(table, index=False))


def render_profile(csv: str) -> str:
    cols = ["variant", "sparsity", "round_to", "device", "threads", "decode", "new_tokens", "runs", "seconds_median",
            "seconds_min", "seconds_max", "prefill_ms", "decode_ms_per_token", "tokens_per_s", "bandwidth_gb_s",
            "peak_mem_mb", "speedup", "bytes_bound", "of_bound"]
    df = pd.read_csv(csv)
    return markdown_table(df[[c for c in cols if c in df.columns]].round(3), index=False)


def render_paper(csv: str) -> str:
    """Our perplexity at 128 × 512 beside the paper's on its closest models (``figures.beside_paper``)."""
    from spap_lib.artifact.figures import beside_paper

    table = beside_paper(csv, PAPER_CSV, "128×512")
    return markdown_table(table, index=False) if len(table) else "(no 128 × 512 rows in results/ablation.csv)"


def _grid_protocol(table: pd.DataFrame) -> pd.DataFrame:
    """The grid's protocol only (perplexity at 512 on the first 40 test windows), without its columns."""
    table = table[(table["eval_seqlen"] == 512) & (table["eval_windows"] == 40)]
    return table.drop(columns=["eval_seqlen", "eval_windows"])


def render_budget128(csv: str) -> str:
    """The 128 × 512 grid on its own: every method at today's defaults (the label is the method; where a model
    has no such row, the method's labelled rows, e.g. ``flap/bias=false`` where there is no bias slot), per
    model, on the first 40 test windows of 512; the best pruned cell of each model and sparsity in bold."""
    from spap_lib.artifact.figures import headline

    wide = _grid_protocol(headline(csv, eval_seqlen=512).reset_index())
    wide = wide[wide["calib"] == "128×512"] if len(wide) else wide
    if not len(wide):
        return "(no 128 × 512 rows in results/ablation.csv)"
    bare = {(m, label) for m, label in zip(wide["model"], wide["label"]) if "/" not in label}
    shown = [label == "dense" or "/" not in label or (m, label.split("/")[0]) not in bare
             for m, label in zip(wide["model"], wide["label"])]
    wide = wide[shown].drop(columns=["calib"])
    sparsities = [c for c in wide.columns if not isinstance(c, str) and c > 0]
    out = wide.rename(columns={"label": "method"}).astype(object)
    for model, rows in wide.groupby("model"):
        for c in sparsities:
            pruned = rows[rows["label"] != "dense"][c].dropna()
            for i in rows.index:
                v = rows.at[i, c]
                out.at[i, c] = "" if pd.isna(v) else f"**{v:.2f}**" if len(pruned) and v == pruned.min() \
                    and rows.at[i, "label"] != "dense" else f"{v:.2f}"
    dense = wide[wide["label"] == "dense"].set_index("model")[0]
    out = out[out["method"] != "dense"].drop(columns=[0])
    out.insert(2, "dense", [f"{dense[m]:.2f}" if m in dense else "" for m in out["model"]])
    out = out[[c for c in out.columns if isinstance(c, str) or (out[c] != "").any()]]  # sparsities measured here
    out.columns = [c if isinstance(c, str) else f"{c:.0%}" for c in out.columns]
    return markdown_table(out, index=False) if len(out) else "(no 128 × 512 rows in results/ablation.csv)"


def render_parts(csv: str) -> str:
    """Every labelled method as its three parts (selection, allocation, update) and its perplexity per sparsity,
    per model and calibration size, on the grid's protocol (``figures.compositions``)."""
    from spap_lib.artifact.figures import compositions

    table = _grid_protocol(compositions(csv)).drop(columns=["label"])
    for c in table.columns:
        if not isinstance(c, str):  # perplexity per sparsity, two decimals (a collapsed run's too), blank if not run
            table[c] = ["" if pd.isna(v) else f"{v:.2f}" for v in table[c]]
    table.columns = [c if isinstance(c, str) else f"{c:.0%}" for c in table.columns]
    return markdown_table(table, index=False, disable_numparse=True)


def render_best(csv: str) -> str:
    """Per model, calibration size and sparsity: the best baseline against the best composition with SPAP's
    alternating update, and the best of those at uniform widths (``figures.best_compositions``)."""
    from spap_lib.artifact.figures import best_compositions

    table = _grid_protocol(best_compositions(csv))
    if not len(table):
        return "(no grid cell with both a baseline and a composition with the alternating update)"
    table["sparsity"] = [f"{x:.0%}" for x in table["sparsity"]]
    return markdown_table(table.round(2), index=False)


def render_tokenizer_split(csv: str) -> str:
    """SmolLM2's cells with the tokenizer ``sl.load`` builds now (``csv``: configs/ablate_own_split.yaml) beside
    the rows of the same cells measured with transformers' build of the GGUF's tokenizer: results/ablation.csv's, and
    those the grid has since measured again, kept in results/ablation_transformers_split.csv."""
    own = _grid_protocol(load_rows(csv))
    kept = Path(csv).with_name("ablation_transformers_split.csv")
    old = pd.concat([load_rows(Path(csv).with_name("ablation.csv"))] + ([load_rows(kept)] if kept.is_file() else []))
    old = _grid_protocol(old)
    if "tokenizer" in old:  # the rows of another tokenizer only
        old = old[~old["tokenizer"].fillna("").isin(set(own["tokenizer"]))]
    cell = ["model", "calib", "label", "sparsity"]
    both = own[cell + ["ppl"]].merge(old[cell + ["ppl"]], on=cell, how="left", suffixes=("_own", "_transformers"))
    both["change"] = [f"{o / t - 1:+.1%}" for o, t in zip(both["ppl_own"], both["ppl_transformers"])]
    both["sparsity"] = [f"{x:.0%}" for x in both["sparsity"]]
    both = both.rename(columns={"ppl_transformers": "transformers' split", "ppl_own": "the model's own split"})
    return markdown_table(both[cell + ["transformers' split", "the model's own split", "change"]].round(2),
                          index=False)


RENDERERS = {"ablation": render_ablation, "zeroshot": render_zeroshot, "profile": render_profile,
             "profile_slicegpt": render_profile, "llamacpp": engines.render, "llamacpp_round_to": engines.render,
             "tokenizer_split": render_tokenizer_split}


def render_blocks(csv: str) -> dict[str, str]:
    """Every block rendered from ``csv``: {marker name: markdown}."""
    kind = max((k for k in RENDERERS if Path(csv).stem.startswith(k)), key=len, default=None)  # the longest match
    if kind is None:
        raise SystemExit(f"{csv}: no table is rendered from it (known: {', '.join(RENDERERS)})")
    more = {"results": render_sweep, "table5": render_table5, "paper": render_paper,
            "budget128": render_budget128, "parts": render_parts, "best": render_best} if kind == "ablation" else {}
    return {kind: RENDERERS[kind](csv), **{name: render(csv) for name, render in more.items()}}


def render_text(blocks: dict[str, str], text: str) -> tuple[str, set[str]]:
    """``text`` with each of ``blocks`` that it holds replaced by a fresh rendering; and the names it held."""
    found = set()
    for name, body in blocks.items():
        start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
        if start in text:
            found.add(name)
            text = re.sub(re.escape(start) + ".*?" + re.escape(end), lambda _: f"{start}\n{body}\n{end}", text,
                          flags=re.S)
    return text, found


def main(argv: list[str]) -> None:
    check = "--check" in argv
    (csv,) = [a for a in argv if a != "--check"]
    blocks = render_blocks(csv)
    seen: set[str] = set()
    for path in DOCS:
        text = path.read_text()
        fresh, found = render_text(blocks, text)
        seen |= found
        if check and fresh != text:  # a committed result changed without its table (or a block was hand-edited)
            raise SystemExit(f"{path.relative_to(REPO)}'s tables are stale for {csv}: "
                             f"run python -m spap_lib.artifact.render {csv}")
        if not check and fresh != text:
            write_text_atomic(path, fresh)
    missing = set(blocks) - seen
    if missing:
        raise SystemExit(f"no <!-- {sorted(missing)[0]}:start --> ... end block in README.md or docs/ for {csv}")


if __name__ == "__main__":
    main(sys.argv[1:])
