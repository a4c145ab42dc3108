"""Healing, measured: a pruned checkpoint distilled from its dense model at several budgets and settings, and each
healed model's WikiText-2 perplexity (the first test windows), zero-shot accuracy and the heal's time.

    python bench/heal.py --checkpoint runs/main/pruned --teacher smollm2-135m --tokens 0 65536 262144 \\
        --points "lr=2e-4" --out bench/results/heal_smollm2_spap20.csv

Each (point, budget) is one heal from the checkpoint, its learning rate decayed over its own budget; budget 0 is the
checkpoint as it is. The healed weights are rounded to the checkpoint's dtype before they are measured, as a saved
heal would be. A row is written as soon as it is measured, and a rerun skips the rows already there for the same
checkpoint, teacher, evaluation and code (a long grid resumes). ``--save DIR`` keeps each healed model as a spap
checkpoint (for llama.cpp).
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import pandas as pd
import torch

import spap_lib as sl
from spap_lib.artifact.checkpoint import prune_record
from spap_lib.artifact.figures import markdown_table
from spap_lib.artifact.manifest import device_name, git_revision, read_checkpoint_manifest
from spap_lib.checks import scalar
from spap_lib.files import write_csv_atomic, write_text_atomic
from spap_lib.heal import heal
from spap_lib.keys import code_digest, source_key
from spap_lib.model.dtypes import saved_dtype
from spap_lib.settings import HealConfig


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="a spap checkpoint (the folder a prune wrote)")
    ap.add_argument("--teacher", help="the dense model it was pruned from")
    ap.add_argument("--tokens", type=int, nargs="+", default=[0, 65536, 262144], help="heal budgets (0: none)")
    ap.add_argument("--points", default="", help="heal settings, ';'-separated, e.g. 'lr=2e-4;lr=5e-4,train=mlp'")
    ap.add_argument("--eval-seqlen", type=int, default=512)
    ap.add_argument("--eval-windows", type=int, default=40)
    ap.add_argument("--tasks", nargs="*", default=[], help="zero-shot tasks, e.g. arc_easy piqa winogrande")
    ap.add_argument("--limit", type=int, default=300, help="questions per task (the first ones)")
    ap.add_argument("--batch-size", type=int, default=16, help="lm-eval's batch size")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--autograd-kl", action="store_true", help="autograd's KL term (F.kl_div of two log-softmaxes) "
                    "instead of distill.kl_sum: the plain loop's, for its speed")
    ap.add_argument("--save", type=Path, default=None, help="keep each healed model as a checkpoint under here")
    ap.add_argument("--out", type=Path, required=True, help="the rows (.csv; a .md table beside it)")
    ap.add_argument("--figure", type=Path, default=None, help="draw perplexity and zero-shot mean against tokens")
    ap.add_argument("--redraw", action="store_true", help="only redraw --figure from --out's rows")
    a = ap.parse_args(argv)
    if not a.redraw and not (a.checkpoint and a.teacher):
        ap.error("--checkpoint and --teacher are needed to measure (or --redraw with --figure)")
    return a


def points(text: str) -> list[dict]:
    """``"lr=2e-4;lr=5e-4,train=mlp"`` as ``[{"lr": 2e-4}, {"lr": 5e-4, "train": "mlp"}]`` ("" is the defaults)."""
    return [{k: scalar(v) for k, v in (kv.split("=") for kv in p.split(",") if kv)} for p in text.split(";")]


def measure(student, a: argparse.Namespace) -> dict:
    """The perplexity on the first test windows and, with ``--tasks``, the zero-shot accuracies and their mean."""
    from spap_lib.evaluation.zeroshot import evaluate

    ppl = sl.perplexity(student.model, student.tokenizer, a.eval_seqlen, a.eval_windows, progress=False)
    row = {"ppl": ppl["ppl"], "windows": ppl["windows"]}
    if a.tasks:
        accs = {r["task"]: r["value"] for r in evaluate(student.model, student.tokenizer, a.tasks, limit=a.limit,
                                                     batch_size=a.batch_size)
                if r["metric"] == "acc"}
        row.update({f"acc_{t}": v for t, v in accs.items()}, acc_mean=sum(accs.values()) / len(accs))
    return row


def autograd_kl(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """The KL term as a plain loop writes it: autograd through both log-softmaxes (``--autograd-kl``)."""
    import torch.nn.functional as F

    ls = F.log_softmax(student.flatten(0, -2).float() / temperature, -1)
    lt = F.log_softmax(teacher.flatten(0, -2).float() / temperature, -1)
    return F.kl_div(ls, lt, log_target=True, reduction="sum") * temperature ** 2


def main(argv=None) -> None:
    a = parse(argv)
    if a.redraw:
        return figure(pd.read_csv(a.out), a.figure)
    if a.autograd_kl:
        from spap_lib.heal import distill

        distill.kl_sum = autograd_kl
    fields = read_checkpoint_manifest(a.checkpoint) or {}
    base = {"checkpoint": str(a.checkpoint), "checkpoint_key": source_key(sl.resolve(str(a.checkpoint))),
            "teacher": a.teacher, "eval": f"{a.eval_windows}x{a.eval_seqlen}", "tasks": " ".join(a.tasks),
            "limit": a.limit if a.tasks else None, "code": code_digest(*_modules()),
            "kl": "autograd" if a.autograd_kl else "kl_sum"}
    dense = ((fields.get("perplexity") or {}).get("dense") or {}).get("ppl")  # the checkpoint's, same protocol
    rows = pd.read_csv(a.out).to_dict("records") if a.out.is_file() else []
    teacher = sl.load(a.teacher, device=a.device)
    for point in points(a.points):
        for tokens in a.tokens:
            label = ",".join(f"{k}={v}" for k, v in point.items()) or "defaults"
            key = {**base, "point": label if tokens else "none", "tokens": tokens}
            if any(all(_same(r.get(k), v) for k, v in key.items()) for r in rows):
                continue
            student = sl.load(str(a.checkpoint), device=a.device)
            started = time.process_time()
            report = heal(student, teacher, HealConfig(tokens=tokens, **point), progress=False) if tokens else {}
            student.onloader.round_weights(saved_dtype(fields) or student.model.dtype)
            row = {**key, "seconds": report.get("seconds", 0.0), "cpu_seconds": time.process_time() - started,
                   "tokens_per_s": report.get("tokens_per_s"), "loss_last": (report.get("loss") or {}).get("last"),
                   **measure(student, a), "dense_ppl": dense, "device": device_name(student.device),
                   "git": git_revision()}
            if a.save and tokens:
                sl.save(student, {**prune_record(a.checkpoint), "heal": report},
                        a.save / f"{label}-{tokens}", overwrite=True, healed_from=str(a.checkpoint))
            rows.append(row)
            _write(a, rows)
            print({k: row[k] for k in ("point", "tokens", "seconds", "ppl")}, flush=True)


def _same(read, value) -> bool:
    """A key's value as read back from the table against the run's: a column with empty cells reads its integers
    back as floats (300 as 300.0), and an empty cell as NaN where the run has None or ""."""
    empty = value is None or (isinstance(value, str) and not value)
    if empty or pd.isna(read):
        return empty and pd.isna(read)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return isinstance(read, (int, float)) and float(read) == float(value)
    return str(read) == str(value)


def _modules():
    from spap_lib.heal import data, distill, state

    return data, distill, state


def _write(a: argparse.Namespace, rows: list[dict]) -> None:
    frame = pd.DataFrame(rows)
    write_csv_atomic(a.out, frame)
    shown = [c for c in ("point", "tokens", "seconds", "tokens_per_s", "ppl", "acc_arc_easy", "acc_piqa",
                         "acc_winogrande", "acc_mean", "device") if c in frame]
    cmd = "python bench/heal.py " + " ".join(os.sys.argv[1:])
    write_text_atomic(a.out.with_suffix(".md"), f"# Healing\n\nCommand: `{cmd}`  \nDevice: "
                      f"{frame['device'].iloc[-1]}; torch {torch.__version__}.\n\n"
                      + markdown_table(frame[shown], index=False) + "\n")
    if a.figure:
        figure(frame, a.figure)


def figure(frame: pd.DataFrame, path: Path) -> None:
    """Perplexity (and, where measured, the zero-shot mean) against healing tokens, one line per setting, the dense
    model's perplexity as a horizontal line; budget 0 drawn at the left edge. Only the rows of the newest row's code
    and device are drawn: a line never joins two versions of the heal or two CPUs (the table keeps them all)."""
    last = frame.iloc[-1]
    frame = frame[(frame["code"] == last["code"]) & (frame["device"] == last["device"])]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from spap_lib.files import atomic_file

    panels = ["ppl"] + (["acc_mean"] if "acc_mean" in frame and frame["acc_mean"].notna().any() else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 3.8), squeeze=False)
    none = frame[frame["tokens"] == 0]
    for ax, col in zip(axes[0], panels):
        for point, rows in frame[frame["tokens"] > 0].groupby("point"):
            rows = pd.concat([none, rows]).dropna(subset=[col]).sort_values("tokens")
            if not (rows["tokens"] > 0).any():  # a setting with no healed point in this panel: no line, no legend
                continue
            ax.plot(rows["tokens"].clip(lower=8192), rows[col], marker="o", label=point)
        if col == "ppl" and frame["dense_ppl"].notna().any():
            ax.axhline(frame["dense_ppl"].dropna().iloc[0], color="k", ls="--", lw=1, label="dense")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("healing tokens (leftmost: none)")
        ax.set_ylabel({"ppl": "WikiText-2 perplexity", "acc_mean": "zero-shot mean accuracy"}[col])
        ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_file(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
