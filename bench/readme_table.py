"""Render committed result tables into README.md (between their markers).

    python bench/readme_table.py bench/results/smollm2_spap.csv      # SPAP sweep   (results:start/end)
    python bench/readme_table.py results/ablation.csv                 # 03_ablate    (ablation:start/end)
    python bench/readme_table.py results/zeroshot.csv                 # 04_evaluate  (zeroshot:start/end)
    python bench/readme_table.py results/profile.csv                  # 05_profile   (profile:start/end)
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pandas as pd

from spap_lib.io import write_text_atomic

README = Path(__file__).resolve().parents[1] / "README.md"
START, END = "<!-- results:start -->", "<!-- results:end -->"


def render(csv: str) -> str:
    df = pd.read_csv(csv)
    ppl = df.pivot_table(index=["method", "sparsity"], columns="eval_seqlen", values="ppl")
    ppl.columns = [f"ppl @ {c}" for c in ppl.columns]
    first = df.drop_duplicates(["method", "sparsity"]).set_index(["method", "sparsity"])
    table = ppl.join(first[["achieved_decoder", "achieved_total", "decoder_params", "total_params", "prune_seconds"]])
    table = table.sort_index(level="sparsity").reset_index()
    digits = {**{c: 2 for c in ppl.columns}, "achieved_decoder": 4, "achieved_total": 4, "prune_seconds": 0}
    return table.round(digits).to_markdown(index=False)


def render_ablation(csv: str) -> str:
    """Perplexity per model/method (rows) and sparsity (columns), methods in the paper's order; the
    model column says how many 512-token test windows were scored."""
    from spap_lib.figures import headline

    windows = pd.read_csv(csv).groupby("model")["eval_windows"].max()
    wide = headline(csv).round(2).reset_index().drop(columns="eval_seqlen")
    wide["model"] = [f"{m} ({windows[m]} windows)" for m in wide["model"]]
    wide.columns = [c if isinstance(c, str) else f"{c:.0%}" for c in wide.columns]
    wide = wide.rename(columns={"0%": "dense"}).astype(object)
    return wide.where(wide.notna(), "").to_markdown(index=False)


def render_zeroshot(csv: str) -> str:
    """Table 3: perplexities, then accuracy (%) per task with the metric the paper reports, and the mean;
    the header says how many examples per task were scored."""
    from spap_lib.zeroshot import table3

    df = pd.read_csv(csv)
    limit = df["limit"].dropna().unique()
    table = table3(df).reset_index()
    table.columns = [c.replace("ppl@", "ppl @ ") for c in table.columns]
    note = f"limit {', '.join(str(int(x)) for x in limit)} examples per task" if len(limit) else "every example"
    return f"({note}; accuracy in %)\n\n" + table.to_markdown(index=False)


def render_profile(csv: str) -> str:
    cols = ["variant", "sparsity", "round_to", "device", "threads", "new_tokens", "runs", "seconds_median", "seconds_min",
            "seconds_max", "peak_mem_mb", "speedup", "bytes_bound", "of_bound"]
    df = pd.read_csv(csv)
    return df[[c for c in cols if c in df.columns]].round(3).to_markdown(index=False)


RENDERERS = {"ablation": render_ablation, "zeroshot": render_zeroshot, "profile": render_profile}


def main(csv: str) -> None:
    kind = next((k for k in RENDERERS if k in Path(csv).name), None)
    start, end, body = ((f"<!-- {kind}:start -->", f"<!-- {kind}:end -->", RENDERERS[kind](csv))
                        if kind else (START, END, render(csv)))
    text = README.read_text()
    if start not in text:
        raise SystemExit(f"README.md has no {start} ... {end} block for {csv}")
    block = f"{start}\n{body}\n{end}"
    write_text_atomic(README, re.sub(re.escape(start) + ".*?" + re.escape(end), block, text, flags=re.S))


if __name__ == "__main__":
    main(sys.argv[1])
