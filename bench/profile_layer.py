"""Where SPAP's time goes on one decoder layer, next to FASP on the same layer.

Captures the dense MLP inputs of one layer of a real model (calibration windows as in the grid),
then prunes that layer with FASP and with SPAP, timing each stage by wrapping the functions that
do the work (Gram passes, Cholesky solves, Adam steps, error evaluations). Writes a CSV + Markdown
twin with the command, so the breakdown in the README is regenerated, not typed.

    python bench/profile_layer.py --model smollm2-135m --layer 15 --nsamples 32 --seqlen 512

On CUDA (``--device cuda``, with ``--random`` where no model files reach the machine) every stage is
synchronised before and after it, so each is charged its own kernels, and a second run of each method
under ``torch.profiler`` adds how long the GPU was busy and how often the host waited for it: a small
layer whose GPU idles most of the time is bound by launches and waits, not by its arithmetic.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from contextlib import contextmanager

import pandas as pd
import torch
from common import (  # bench/, the script's own folder
    RANDOM_NOTE,
    device_arguments,
    random_calibration,
    random_checkpoint,
    synchronize,
)

import spap_lib as sl
from spap_lib.artifact.figures import markdown_table
from spap_lib.artifact.manifest import device_name, git_revision
from spap_lib.files import write_csv_atomic, write_text_atomic
from spap_lib.methods import LayerProblem
from spap_lib.methods.spap import alternating
from spap_lib.model.capture import first_layer_inputs, replay
from spap_lib.model.loading import pick_device
from spap_lib.numerics import linalg, solve

# (module, function name, stage label): the functions that do the work, wrapped with a timer
STAGES = [
    (linalg, "gram", "Gram passes (Z Zᵀ, Y Zᵀ)"),
    (solve, "solve_spd", "Cholesky solves"),
    (alternating, "adam_steps_on", "Adam steps"),
    (alternating, "calibration_error", "error evaluations"),
    (solve, "reconstruction_error", "errors from Gram statistics"),
    (linalg, "gram_and_outputs", "dense Gram pass with the targets"),
]


@contextmanager
def timed(totals: dict, device: torch.device):
    originals = []
    for module, name, label in STAGES:
        fn = getattr(module, name)
        originals.append((module, name, fn))

        def wrapper(*a, _fn=fn, _label=label, **k):
            synchronize(device)  # CUDA runs ahead of the host: charge each stage its own kernels
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                synchronize(device)
                totals[_label] += time.perf_counter() - t0

        setattr(module, name, wrapper)
        # modules that imported the function by name hold their own reference
        for other in [m for key, m in sys.modules.items() if key.startswith("spap_lib.") and m is not module]:
            if getattr(other, name, None) is fn:
                originals.append((other, name, fn))
                setattr(other, name, wrapper)
    try:
        yield
    finally:
        for module, name, fn in originals:
            setattr(module, name, fn)


# host calls that wait for the GPU (a copy from pageable host memory waits for the stream too: counted as a copy)
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def traced(run, device: torch.device) -> dict:
    """One more run under ``torch.profiler``: seconds of kernels and copies on the GPU, host waits for it,
    copies and kernel launches. Busy time far below the wall time: the host's launches and waits bound the layer."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        synchronize(device)
    events = prof.events()
    on_gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    names = [e.name for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    return {"GPU busy (kernels and copies)": sum(e.time_range.elapsed_us() for e in on_gpu) / 1e6,
            "host waits (count of synchronize calls)": sum(n.startswith(WAITS) for n in names),
            "copies (count of cudaMemcpy calls)": sum(n.startswith("cudaMemcpy") for n in names),
            "kernel launches (count)": sum("LaunchKernel" in n for n in names)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--layer", type=int, default=15)
    ap.add_argument("--sparsity", type=float, default=0.2)
    ap.add_argument("--nsamples", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=512)
    # method labels, each may carry hyperparameters (``spap/lr=0.01,sketch_tokens=24576``)
    ap.add_argument("--methods", nargs="+", default=["fasp", "spap_no_update", "spap", "spap_gd"])
    # the Gram product in this many blocks of rows (``linalg.GRAM_BLOCKS``; 1 is the whole product), each in turn
    ap.add_argument("--gram-blocks", type=int, nargs="+", default=[linalg.GRAM_BLOCKS])
    device_arguments(ap)
    ap.add_argument("--out", default="bench/results/profile_layer.csv")
    args = ap.parse_args(argv)
    command = " ".join(["python", "bench/profile_layer.py", *(sys.argv[1:] if argv is None else argv)])
    device = pick_device(args.device)
    if args.random:  # the model's shapes, built here: no model files needed
        loaded = sl.load(str(random_checkpoint(args.model, args.layer + 1, device)), device=args.device)
        calib = random_calibration(loaded.model.config.vocab_size, args.nsamples, args.seqlen, seed=0)
    else:
        loaded = sl.load(args.model, device=args.device)
        calib = sl.calibration_windows(loaded.tokenizer, args.nsamples, args.seqlen, 0)
    layers = loaded.adapter.layers()
    hidden, kwargs = first_layer_inputs(loaded.model, layers, calib.windows, 1, loaded.device)
    for i, layer in enumerate(layers[:args.layer + 1]):
        out, X = replay(layer, hidden, {b: kw[i] for b, kw in kwargs.items()}, 1,
                        watch=loaded.adapter.mlp_input_module(layer))
        hidden = out
    plan = sl.plan_sparsity(loaded.adapter, args.sparsity)
    rows, results, same = [], {}, []
    for blocks in args.gram_blocks:
        linalg.GRAM_BLOCKS = blocks  # read by ``add_gram`` at every call
        for name in args.methods:
            label = name if len(args.gram_blocks) == 1 else f"{name} [Gram in {blocks} blocks]"
            method = sl.get_method(name)

            def problem() -> LayerProblem:  # a fresh one for every run: a problem caches its Gram matrix and targets
                return LayerProblem.of(method, loaded.adapter.get_mlp(layers[args.layer]), X, plan.n_remove,
                                       layer_index=args.layer)

            totals: dict = defaultdict(float)
            if device.type == "cuda":  # the first call of each kernel loads it: warm up outside the clock
                method.prune(problem())
            synchronize(device)
            t0 = time.perf_counter()
            with timed(totals, device):
                result = method.prune(problem())
            total = time.perf_counter() - t0
            if name in results:  # the answer against the first setting's
                keep, W = results[name]
                diff = float((result.mlp.W_out - W).abs().max() / W.abs().max()) if torch.equal(result.keep, keep) \
                    else float("nan")
                same.append(f"{label}: " + (f"the same kept channels, largest output-weight difference {diff:.1e} of "
                                            "the largest weight" if diff == diff else "other kept channels"))
            results.setdefault(name, (result.keep, result.mlp.W_out))
            rows += [{"method": label, "stage": stage, "seconds": sec} for stage, sec in totals.items()]
            rows.append({"method": label, "stage": "other (penalty loop bookkeeping, selection, copies)",
                         "seconds": total - sum(totals.values())})
            rows.append({"method": label, "stage": "total", "seconds": total})
            if device.type == "cuda":  # unsynchronised, as a prune runs, and traced
                synchronize(device)
                t0 = time.perf_counter()
                method.prune(problem())
                synchronize(device)
                rows.append({"method": label, "stage": "total, stages not synchronised",
                             "seconds": time.perf_counter() - t0})
                rows += [{"method": label, "stage": k, "seconds": v}  # counts, where the stage says so
                         for k, v in traced(lambda: method.prune(problem()), device).items()]
            print(label, f"{total:.2f} s", dict(totals), flush=True)
    frame = pd.DataFrame(rows)
    frame["model"], frame["layer"], frame["tokens"] = args.model, args.layer, args.nsamples * args.seqlen
    write_csv_atomic(args.out, frame)
    totals = frame[frame["stage"] == "total"].set_index("method")["seconds"]
    wide = frame.pivot_table(index="stage", columns="method", values="seconds", sort=False).round(
        2 if device.type == "cpu" else 4)  # a small layer's stages on a GPU take milliseconds

    def fasp_of(label: str) -> str:  # FASP at the same Gram blocks
        return label.replace(label.split(" [")[0], "fasp", 1)

    ratios = ", ".join(f"{m} {totals[m] / totals[fasp_of(m)]:.1f}x" for m in totals.index if fasp_of(m) in totals)
    write_text_atomic(args.out.replace(".csv", ".md"), (
        f"# One-layer time breakdown\n\nCommand: `{command}`  \nRevision: `{git_revision()}`  \n"
        f"Device: {device_name(device)}{RANDOM_NOTE if args.random else ''}; "
        f"{loaded.model.dtype} weights; layer {args.layer} of {args.model}, "
        f"{args.nsamples} x {args.seqlen} calibration tokens, sparsity {args.sparsity}, hyperparameters as "
        f"labelled (the rest default).\n\n{markdown_table(wide)}\n\nRatio to FASP: {ratios}\n"
        + "".join(f"\n* {line} (against the first Gram setting)" for line in same) + ("\n" if same else "")))

if __name__ == "__main__":
    main()
