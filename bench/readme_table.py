"""Render committed result tables into README.md (between their markers).

    python bench/readme_table.py bench/results/smollm2_spap.csv      # SPAP sweep   (results:start/end)
    python bench/readme_table.py results/ablation.csv                 # 03_ablate    (ablation:start/end)
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


def main(csv: str) -> None:
    start, end, body = (("<!-- ablation:start -->", "<!-- ablation:end -->", render_ablation(csv))
                        if "ablation" in Path(csv).name else (START, END, render(csv)))
    text = README.read_text()
    block = f"{start}\n{body}\n{end}"
    write_text_atomic(README, re.sub(re.escape(start) + ".*?" + re.escape(end), block, text, flags=re.S))


if __name__ == "__main__":
    main(sys.argv[1])
