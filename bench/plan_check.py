"""The plan's predictions against a measured prune on this machine.

Prunes a real model with SPAP on the grid's calibration protocol and compares the measured working
memory (peak resident set during the prune minus the resident set before it: activations, the
layer's solver state, temporaries) and prune time with what ``spap_lib.plan`` predicted from the
config alone. ``--hparams`` shortens the run (memory does not depend on the iteration counts). A
warm-up prune on two windows comes first, so the measured row is a prune's steady state; the first
prune of a process also pays for library initialisation and the allocator's growth (reported too).

    python bench/plan_check.py --model smollm2-135m --nsamples 32 --seqlen 512
    python bench/plan_check.py --models wide:1024x8192 --nsamples 32 --seqlen 1024 --hparams '{"K": 2, "am_iters": 1}'

``wide:<d>x<n>``: a random two-layer Llama of hidden size d and MLP width n (random tokens), for a layer wider
than the offline models' (the solver's n × n state then dominates the working memory).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

import spap_lib as sl
from spap_lib.artifact.figures import markdown_table
from spap_lib.artifact.manifest import device_name, git_revision
from spap_lib.evaluation.data import Calibration
from spap_lib.files import write_csv_atomic, write_text_atomic
from spap_lib.plan import plan


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m")
    ap.add_argument("--method", default="spap")
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--hparams", default="{}", help="JSON overrides of the method's defaults")
    ap.add_argument("--out", default="bench/results/plan_check.csv")
    ap.add_argument("--note", default="", help="what the row's conditions were (e.g. another job on the cores)")
    args = ap.parse_args(argv)
    command = " ".join(["python", "bench/plan_check.py", *(sys.argv[1:] if argv is None else argv)])
    hparams = json.loads(args.hparams)
    out = Path(args.out)
    table = pd.read_csv(out) if out.is_file() else pd.DataFrame()
    for model in args.models.split(","):
        loaded, calib, config = _wide(model, args.nsamples, args.seqlen) if model.startswith("wide:") else \
            (sl.load(model, device="cpu"), None, None)
        p = plan(model, method=args.method, hparams=hparams, nsamples=args.nsamples, seqlen=args.seqlen,
                 eval_seqlen=args.seqlen, device="cpu-2core", config=config)
        calib = calib or sl.calibration_windows(loaded.tokenizer, args.nsamples, args.seqlen, 0)
        first = sl.prune(loaded.copy(), Calibration(calib.windows[:2], calib.starts[:2], calib.split, calib.source,
                                                    calib.corpus_tokens, 0), args.method, 0.2, hparams=hparams,
                         progress=False)["memory"]
        report = sl.prune(loaded, calib, args.method, 0.2, hparams=hparams, progress=False)
        mem = report["memory"]
        row = {"model": model, "method": args.method, "hparams": json.dumps(hparams),
               "tokens": args.nsamples * args.seqlen,
               "predicted working GB": round(p.prune_working_gb, 3),
               "measured working GB": round((mem["peak_rss_mb"] - mem["rss_before_mb"]) / 1024, 3),
               "first prune in process GB (2 windows)":
                   round((first["peak_rss_mb"] - first["rss_before_mb"]) / 1024, 3),
               "resident before GB": round(mem["rss_before_mb"] / 1024, 3),
               "predicted weights GB": p.memory_gb["weights"],
               "predicted prune s": round(p.prune_seconds),
               "measured prune s": round(report["seconds"]), "device": device_name("cpu"), "command": command,
               "revision": git_revision(),
               "note": args.note}
        table = pd.concat([table, pd.DataFrame([row])], ignore_index=True)
        write_csv_atomic(out, table)
        print(row, flush=True)
    write_text_atomic(out.with_suffix(".md"), (
        "# The plan against measured prunes (on the CPU, float32)\n\nEach row names its device, command and revision "
        "(where they were recorded).  \nWorking memory = peak resident set during the prune minus the "
        "resident set before it (weights, Python and libraries); predicted = the plan's peak minus weights and "
        "evaluation logits. Prune time: the plan's compute-only estimate from the measured rates of the machine it "
        "ran on.\n\n"
        + markdown_table(table, index=False) + "\n"))


def _wide(name: str, nsamples: int, seqlen: int):
    """A random two-layer Llama of the shape ``wide:<d>x<n>`` on random tokens: (loaded, calibration, config)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from spap_lib.model.loading import Loaded
    from spap_lib.model.sources import ModelSource

    d, n = (int(x) for x in name.removeprefix("wide:").split("x"))
    config = LlamaConfig(vocab_size=256, hidden_size=d, intermediate_size=n, num_hidden_layers=2,
                         num_attention_heads=max(1, d // 128), num_key_value_heads=max(1, d // 256),
                         max_position_embeddings=max(seqlen, 2048))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    windows = torch.randint(0, 256, (nsamples, seqlen), generator=torch.Generator().manual_seed(0))
    loaded = Loaded(model, None, sl.get_adapter(model), ModelSource(name, "random", "-"), torch.device("cpu"))
    return loaded, Calibration(windows, torch.arange(nsamples), "random", "random tokens", windows.numel(), 0), config


if __name__ == "__main__":
    main()
