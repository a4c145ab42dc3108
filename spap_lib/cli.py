"""``spap``: the command line for people who do not use notebooks, thin over the calls 02_prune makes.

    spap prune MODEL --sparsity 0.2 --method spap --out DIR [--nsamples --seqlen --offload --device --seed]
    spap plan MODEL [--device h100 --nsamples 128 --seqlen 2048 --offload auto]
    spap eval CHECKPOINT [--eval-seqlen 2048 --eval-windows N]

Defaults are the paper's settings (128 × 2048 calibration tokens, perplexity on the whole WikiText-2
test split at 2048). Every error is the library's own, before any weight is read where it can be;
``prune`` writes the same checkpoint and manifest as the notebook and prints its ``prune_result``.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PAPER = {"nsamples": 128, "seqlen": 2048, "eval_seqlen": 2048}


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda, cuda:1 ...")
    p.add_argument("--offload", default="auto", help="none | cpu | disk | auto (what the plan says fits)")


def _eval_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--eval-seqlen", type=int, default=PAPER["eval_seqlen"], help="perplexity window (paper: 2048)")
    p.add_argument("--eval-windows", type=int, default=None, help="cap on test windows (default: the whole split)")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="spap", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prune", help="prune a model and save a checkpoint stock transformers loads")
    p.add_argument("model", help="alias (spap plan --list), hub id, local checkpoint dir or .gguf file")
    p.add_argument("--out", required=True, help="checkpoint directory (new, empty, or a previous spap checkpoint)")
    p.add_argument("--method", default="spap")
    p.add_argument("--sparsity", type=float, default=0.2, help="share of decoder parameters to remove")
    p.add_argument("--nsamples", type=int, default=PAPER["nsamples"], help="calibration windows (paper: 128)")
    p.add_argument("--seqlen", type=int, default=PAPER["seqlen"], help="tokens per calibration window (paper: 2048)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hparams", type=json.loads, default={}, help='method hyperparameters as JSON, e.g. \'{"K": 10}\'')
    p.add_argument("--round-to", type=int, default=None, help="kept MLP widths a multiple of this")
    p.add_argument("--overwrite", action="store_true", help="replace a previous spap checkpoint at --out")
    p.add_argument("--no-eval", action="store_true", help="skip the dense and pruned perplexity")
    p.add_argument("--resume-dir", default=None, help="save every finished layer here; rerunning the same command "
                   "resumes after the last one (hours-long prunes); removed when the prune completes")
    _common(p)
    _eval_args(p)

    p = sub.add_parser("plan", help="peak memory and time of a prune, from the config alone")
    p.add_argument("model", nargs="?", help="alias, hub id, local checkpoint dir or .gguf file")
    p.add_argument("--list", action="store_true", help="list the model aliases and planning devices")
    p.add_argument("--method", default="spap")
    p.add_argument("--sparsity", type=float, default=0.2)
    p.add_argument("--nsamples", type=int, default=PAPER["nsamples"])
    p.add_argument("--seqlen", type=int, default=PAPER["seqlen"])
    p.add_argument("--device", default=None, help="a row of throughput.json (h100, rtx4090, cpu-2core); "
                                                   "default: this machine's")
    p.add_argument("--device-memory-gb", type=float, default=None)
    p.add_argument("--host-memory-gb", type=float, default=None)
    p.add_argument("--offload", default="auto")
    _eval_args(p)

    p = sub.add_parser("eval", help="WikiText-2 perplexity of a model or checkpoint")
    p.add_argument("model", help="a spap checkpoint, alias, hub id, local dir or .gguf file")
    _common(p)
    _eval_args(p)
    return ap


def _prune(a) -> dict:
    import spap_lib as sl
    from spap_lib.api import dense_perplexity, get_calibration, prune_result

    out = Path(a.out).expanduser()
    job = sl.check_run(a.model, method=a.method, sparsity=a.sparsity, hparams=a.hparams, nsamples=a.nsamples,
                       seqlen=a.seqlen, eval_seqlen=a.eval_seqlen, eval_windows=a.eval_windows, seed=a.seed,
                       round_to=a.round_to, device=a.device, out_dir=out, overwrite=a.overwrite, offload=a.offload,
                       spill_dir=out.parent)
    print(job.summary(), flush=True)
    loaded = sl.load(a.model, device=a.device, offload=job.offload, spill_dir=out.parent)
    calib = get_calibration(loaded, a.model, a.nsamples, a.seqlen, a.seed)
    ppl = {}
    if not a.no_eval:
        ppl["dense"] = dense_perplexity(loaded, a.model, a.eval_seqlen, a.eval_windows)
    report = sl.prune(loaded, calib, a.method, a.sparsity, hparams=a.hparams, seed=a.seed, round_to=a.round_to,
                      resume_dir=a.resume_dir)
    if not a.no_eval:
        ppl["pruned"] = sl.perplexity(loaded.model, loaded.tokenizer, a.eval_seqlen, a.eval_windows,
                                      onloader=loaded.onloader)
    report["perplexity"] = ppl
    report["plan"] = job.memory_time.as_dict() if job.memory_time else None
    sl.save(loaded, report, out, overwrite=a.overwrite)
    loaded.onloader.close()
    return prune_result(a.model, a.method, a.sparsity, out, report)  # what 02 writes as prune_result.json


def _plan(a) -> str:
    from spap_lib.models import known_models, pick_device
    from spap_lib.plan import THROUGHPUT, available_host_gb, local_device, plan

    if a.list or not a.model:
        return "models: " + " ".join(known_models()) + "\nplanning devices: " + " ".join(THROUGHPUT)
    device, memory = (a.device, a.device_memory_gb) if a.device else local_device(pick_device("auto"))
    host = a.host_memory_gb if a.host_memory_gb is not None else (available_host_gb() if not a.device else None)
    p = plan(a.model, method=a.method, sparsity=a.sparsity, nsamples=a.nsamples, seqlen=a.seqlen,
             eval_seqlen=a.eval_seqlen, eval_windows=a.eval_windows, device=device,
             device_memory_gb=a.device_memory_gb or memory, host_memory_gb=host, offload=a.offload)
    return p.table()


def _eval(a) -> dict:
    import spap_lib as sl
    from spap_lib.onload import check_offload

    offload = "none" if check_offload(a.offload) == "auto" else a.offload
    loaded = sl.load(a.model, device=a.device, offload=offload)
    result = sl.perplexity(loaded.model, loaded.tokenizer, a.eval_seqlen, a.eval_windows, onloader=loaded.onloader)
    loaded.onloader.close()
    return {"model": a.model, **result}


def main(argv: list[str] | None = None) -> int:
    from spap_lib.checks import ParameterError

    a = parser().parse_args(argv)
    try:
        if a.command == "prune":
            out = _prune(a)
        elif a.command == "plan":
            print(_plan(a))
            return 0
        else:
            out = _eval(a)
    except (ParameterError, ValueError, FileNotFoundError) as err:  # the library's clear messages, no traceback
        print(f"spap {a.command}: {err}", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
