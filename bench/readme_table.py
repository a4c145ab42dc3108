"""Render the committed benchmark table into README.md (between the results markers).

    python bench/readme_table.py bench/results/smollm2_spap.csv
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


def main(csv: str) -> None:
    text = README.read_text()
    block = f"{START}\n{render(csv)}\n{END}"
    write_text_atomic(README, re.sub(re.escape(START) + ".*?" + re.escape(END), block, text, flags=re.S))


if __name__ == "__main__":
    main(sys.argv[1])
