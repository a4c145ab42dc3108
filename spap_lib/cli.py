"""``spap``: the command line for people who do not use notebooks, thin over the calls 02_prune makes.

    spap prune MODEL --sparsity 0.2 --method spap --out DIR [--nsamples --seqlen --offload --device --seed]
    spap plan MODEL [--device h100 --nsamples 128 --seqlen 2048 --offload auto]
    spap heal CHECKPOINT --teacher MODEL --out DIR [--heal-tokens 262144 --heal-data FILE --heal '{"lr": 2e-4}']
    spap eval CHECKPOINT [--eval-seqlen 2048 --eval-windows N]

Defaults are the paper's settings (128 × 2048 calibration tokens, perplexity on the whole WikiText-2
test split at 2048). A refusal (bad input, an incomplete checkpoint, a full disk) is one line on stderr
and exit status 2, before any weight is read where it can be (``--debug`` adds its traceback);
``prune`` writes the same checkpoint and manifest as the notebook and prints its ``prune_result``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from spap_lib.settings import RunConfig, add_options, options

# The options that ``RunConfig`` declares, per command: their types, help and defaults come from there.
PRUNE = ("method", "sparsity", "nsamples", "seqlen", "seed", "hparams", "round_to", "save_dtype", "device", "offload",
         "eval_seqlen", "eval_windows", "heal_tokens", "heal_data", "heal")
PLAN = ("method", "sparsity", "nsamples", "seqlen", "offload", "round_to", "eval_seqlen", "eval_windows",
        "heal_tokens", "heal_data", "heal")
HEAL = ("heal_tokens", "heal_data", "heal", "save_dtype", "device", "eval_seqlen", "eval_windows")
EVAL = ("device", "offload", "eval_seqlen", "eval_windows")


def _path(text: str) -> str:
    """A folder as the user means it: ``~`` expanded and ``o/x/../q`` read as ``o/q`` before any check, so that no
    folder on the way is created, and one folder has one name (the checks compare paths)."""
    return os.path.normpath(os.path.expanduser(text)) if text else text


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="spap", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--debug", action="store_true", help="show the traceback of a refusal too (for bug reports)")
    sub = ap.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prune", help="prune a model and save a checkpoint stock transformers loads")
    p.add_argument("model", help="alias (spap plan --list), hub id, local checkpoint dir or .gguf file")
    p.add_argument("--out", required=True, type=_path,
                   help="checkpoint directory (new, empty, or a previous spap checkpoint)")
    # the command line keeps widths that llama.cpp's blocks divide (docs/llamacpp.md); 02 the paper's own
    add_options(p, PRUNE, round_to="auto")
    p.add_argument("--overwrite", action="store_true", help="replace a previous spap checkpoint at --out")
    p.add_argument("--no-eval", action="store_true", help="skip the dense and pruned perplexity")
    p.add_argument("--resume-dir", default=None, type=_path,
                   help="save every finished layer here; rerunning the same command "
                   "resumes after the last one (hours-long prunes); removed when the prune completes")

    p = sub.add_parser("plan", help="peak memory and time of a prune, from the config alone")
    p.add_argument("model", nargs="?", help="alias, hub id, local checkpoint dir or .gguf file")
    p.add_argument("--list", action="store_true", help="list the model aliases and planning devices")
    add_options(p, PLAN, round_to="auto")
    p.add_argument("--device", default=None, help="a row of throughput.json (h100, rtx4090, cpu-2core); "
                                                   "default: this machine's")
    p.add_argument("--device-memory-gb", type=float, default=None)
    p.add_argument("--host-memory-gb", type=float, default=None)
    p.add_argument("--world-size", type=int, default=1, help="ranks of a torchrun prune: one rank's memory and "
                   "time (its share of the windows), and the all-reduce traffic")
    p.add_argument("--link", choices=("nvlink", "ethernet"), default=None, help="the ranks' link, whose rate prices "
                   "the all-reduce in the plan's time (default: nvlink for a GPU, ethernet for a CPU)")

    p = sub.add_parser("heal", help="distil a pruned checkpoint from its dense model and save the healed one")
    p.add_argument("model", metavar="checkpoint", type=_path, help="a spap checkpoint (the folder a prune wrote)")
    p.add_argument("--teacher", required=True, help="the dense model it was pruned from: alias, hub id, local "
                   "checkpoint dir or .gguf file")
    p.add_argument("--out", required=True, type=_path, help="the healed checkpoint's directory")
    add_options(p, HEAL, heal_tokens=262144)
    p.add_argument("--overwrite", action="store_true", help="replace a previous spap checkpoint at --out")
    p.add_argument("--no-eval", action="store_true", help="skip the healed perplexity")
    p.add_argument("--resume-dir", default=None, type=_path, help="save the heal's state here every few "
                   "minutes; rerunning the same command resumes from it")

    p = sub.add_parser("eval", help="WikiText-2 perplexity of a model or checkpoint")
    p.add_argument("model", help="a spap checkpoint, alias, hub id, local dir or .gguf file")
    add_options(p, EVAL)
    return ap


def _prune(a) -> dict | None:
    """``spap prune``: ``run.PruneRun``'s steps, on each rank of a data-parallel run (torchrun) or in this process."""
    from spap_lib.artifact.card import command
    from spap_lib.pipeline import distributed
    from spap_lib.run import PruneRun

    w, device = distributed.start(a.device)  # one rank of several under torchrun; else this process alone
    settings = RunConfig(a.model, **{**options(PRUNE, a), "device": device}, evaluate=not a.no_eval)
    run = PruneRun(settings, Path(a.out), overwrite=a.overwrite, resume_dir=a.resume_dir)
    summary = run.check()
    if w.parallel:  # the ranks were given the same model and settings, and each has a window to hold
        distributed.check_size(a.nsamples)
        distributed.agree("run", run.agreed())
    if w.rank == 0:
        print(summary, flush=True)
    run.load()
    run.calibrate()
    run.prune()
    run.heal()
    return run.save(command(a.argv, w.size))


def _heal(a) -> dict:
    """``spap heal``: ``run.HealRun``'s steps."""
    from spap_lib.artifact.card import command
    from spap_lib.run import HealRun

    settings = RunConfig(a.model, **options(HEAL, a), evaluate=not a.no_eval)
    return HealRun(settings, a.teacher, Path(a.out), overwrite=a.overwrite, resume_dir=a.resume_dir).run(
        command(a.argv))


def _plan(a) -> str:
    from spap_lib.checks import Spec, check_values
    from spap_lib.errors import ParameterError
    from spap_lib.methods import get_method
    from spap_lib.model.loading import pick_device
    from spap_lib.model.sources import known_models
    from spap_lib.pipeline.blocks import resolve_round_to
    from spap_lib.plan import THROUGHPUT, available_host_gb, layer_shapes, local_device, mlp_width, model_config, plan
    from spap_lib.validate import check_config

    if a.list or not a.model:
        return "models: " + " ".join(known_models()) + "\nplanning devices: " + " ".join(THROUGHPUT)
    check_values(("nsamples", a.nsamples, Spec(int, ge=1)),  # before the ranks that share them
                 ("device_memory_gb", a.device_memory_gb, Spec(float, gt=0, optional=True)),  # 0 is not "unset"
                 ("host_memory_gb", a.host_memory_gb, Spec(float, gt=0, optional=True)))
    config, method = model_config(a.model), get_method(a.method)
    a.round_to = resolve_round_to(a.round_to, mlp_width(config), method.pipeline == "layers")
    # what spap prune refuses from the config (a window past the context, a sparsity that removes no channel or
    # every one) is refused here too: a plan of a run that cannot start says nothing
    check_config(a.model, config, method, a.sparsity, {"seqlen": a.seqlen, "eval_seqlen": a.eval_seqlen},
                 {"round_to": a.round_to})
    device, memory = (a.device, a.device_memory_gb) if a.device else local_device(pick_device("auto"))
    host = a.host_memory_gb if a.host_memory_gb is not None else (available_host_gb() if not a.device else None)
    if a.world_size < 1 or a.world_size > a.nsamples:
        raise ParameterError(f"--world-size {a.world_size}: give 1 to --nsamples ({a.nsamples}) ranks; every rank "
                             "holds at least one window")
    per_rank = -(-a.nsamples // a.world_size)  # the largest share (``distributed.share``)
    p = plan(a.model, method=a.method, sparsity=a.sparsity, nsamples=per_rank, seqlen=a.seqlen,
             eval_seqlen=a.eval_seqlen, eval_windows=a.eval_windows, device=device,
             device_memory_gb=a.device_memory_gb or memory, host_memory_gb=host, offload=a.offload,
             round_to=a.round_to, config=config, heal=_heal_of(a))
    shapes = layer_shapes(config, a.sparsity, a.round_to)
    widths = _width_lines(method, a.round_to, shapes)
    if a.world_size == 1:
        return "\n".join([p.table(), *widths])
    from spap_lib.pipeline.distributed import LINKS, allreduce_lines, allreduce_seconds

    head = f"world size {a.world_size}: one rank's plan, {per_rank} of {a.nsamples} windows (the decoder layer is " \
           "replicated; the perplexity's windows are shared too)"
    link = a.link or ("ethernet" if p.device.startswith("cpu") else "nvlink")
    p.seconds[f"all-reduce, {LINKS[link][0]}"] = allreduce_seconds(method, shapes, a.world_size, link)
    return "\n".join([head, p.table(), *widths, *allreduce_lines(method, shapes, a.world_size)])


def _heal_of(a):
    """The plan's heal: ``--heal-tokens`` and its options (None without a budget)."""
    from spap_lib.settings import HealConfig

    heal = HealConfig.of(RunConfig(a.model, heal_tokens=a.heal_tokens, heal_data=a.heal_data, heal=a.heal))
    return heal if heal.tokens else None


def _width_lines(method, round_to: int | None, shapes: dict) -> list[str]:
    """The kept MLP width the plan priced (``plan.layer_shapes``), its multiple, and what it costs in llama.cpp (as
    ``spap prune`` says)."""
    from spap_lib.pipeline.blocks import width_note

    if method.pipeline != "layers" or not method.uniform_widths:  # no MLP channels kept, or one width per layer
        return []
    rounding = f"round_to {round_to}" if round_to else "the method's own width"
    note = width_note([shapes["kept"]])
    return [f"  kept MLP width {shapes['kept']} of {shapes['width']} ({rounding})", *([f"  {note}"] if note else [])]


def _eval(a) -> dict:
    import spap_lib as sl
    from spap_lib.artifact.card import command
    from spap_lib.artifact.checkpoint import add_evaluation, checkpoint_digests

    local = Path(a.model).expanduser()
    # a checkpoint's folder is where a killed prune with --out there left its spill folder: cleaned first
    spill = local.absolute().parent if local.exists() else None
    digests = checkpoint_digests(local) if local.is_dir() else None  # the model about to be checked and read
    job = sl.check_run(a.model, eval_seqlen=a.eval_seqlen, eval_windows=a.eval_windows, device=a.device,
                       offload=a.offload, spill_dir=spill)
    loaded = sl.load(a.model, device=a.device, offload=job.offload, spill_dir=spill)
    result = sl.perplexity(loaded.model, loaded.tokenizer, a.eval_seqlen, a.eval_windows, onloader=loaded.onloader)
    loaded.onloader.close()
    if local.is_dir():  # a spap checkpoint's card and manifest record it
        unrecorded = add_evaluation(local, {"task": "wikitext2 perplexity", "value": result["ppl"],
                                            "command": command(a.argv),
                                            "protocol": f"{result['windows']} windows of {result['seqlen']} tokens"},
                                    digests)
        if unrecorded:
            print(f"spap eval: not recorded: {unrecorded}", file=sys.stderr)
    return {"model": a.model, **result}


def main(argv: list[str] | None = None) -> int:
    from spap_lib.errors import SpapError, surface

    a = parser().parse_args(argv)
    a.argv = sys.argv[1:] if argv is None else list(argv)  # for the model card: the command as typed
    try:
        with surface("cli"):  # refusals name --flags, not keyword arguments
            if a.command == "prune":
                out = _prune(a)
                if out is None:  # a data-parallel prune's other ranks: rank 0 prints the result
                    return 0
            elif a.command == "plan":
                print(_plan(a))
                return 0
            elif a.command == "heal":
                out = _heal(a)
            else:
                out = _eval(a)
    except (SpapError, OSError) as err:  # a refusal or an I/O error of a source or output: one line, exit 2
        if a.debug:
            raise
        print(f"spap {a.command}: {_one_line(err)}", file=sys.stderr)
        return 2
    print(json.dumps(out, indent=2, default=str))
    return 0


def _one_line(err: BaseException) -> str:
    """The message, and for an OSError the file and the reason (``No space left on device: 'out/x'``);
    a multi-line refusal (the plan's table) is kept whole."""
    if isinstance(err, OSError) and err.strerror:
        return f"{err.strerror}: {err.filename!r}" if err.filename else err.strerror
    return str(err) or type(err).__name__


if __name__ == "__main__":
    sys.exit(main())
