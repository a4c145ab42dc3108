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
from spap_lib.methods.spap import alternating, penalty
from spap_lib.model.capture import first_layer_inputs, replay
from spap_lib.model.loading import pick_device
from spap_lib.numerics import collective, linalg, solve

# (module, function name, stage label): the functions that do the work, wrapped with a clock. A stage called
# inside another is a row of its own, named by the path to it ("rounds › Adam steps"), and the outer stage keeps
# only the time (and FLOPs) of its own
STAGES = [
    (linalg, "gram_and_outputs", "dense pass (Z₀Z₀ᵀ and the targets Y)"),
    (penalty, "penalty_method", "penalty loop (Alg. 1)"),
    (alternating, "best_round", "rounds"),
    (alternating, "adam_steps_on", "Adam steps"),
    (collective, "subsample", "token samples"),
    (linalg, "gram", "Gram pass (Z Zᵀ, Y Zᵀ)"),
    (solve, "solve_spd", "solves"),
    (alternating, "calibration_error", "error evaluations"),
    (solve, "reconstruction_error", "errors from Gram statistics"),
]
# callables passed as keywords to a staged function, staged too: the best round's refit on every token
KEYWORD_STAGES = {"full_error": "final refit on every token"}
SEP = " › "


class Clock:
    """Seconds, and with ``counter`` (a ``FlopCounterMode``) FLOPs, of every stage path, each charged its own only."""

    def __init__(self, totals: dict, device: torch.device, counter=None, flops: dict | None = None):
        self.totals, self.device, self.counter, self.flops = totals, device, counter, flops
        self.stack: list[list] = []  # [label, start time, children's seconds, FLOPs at start, children's FLOPs]

    def _count(self) -> float:
        return self.counter.get_total_flops() if self.counter is not None else 0.0

    @contextmanager
    def stage(self, label: str):
        synchronize(self.device)  # CUDA runs ahead of the host: charge each stage its own kernels
        frame = [label, time.perf_counter(), 0.0, self._count(), 0.0]
        self.stack.append(frame)
        try:
            yield
        finally:
            synchronize(self.device)
            self.stack.pop()
            seconds, flops = time.perf_counter() - frame[1], self._count() - frame[3]
            path = SEP.join([f[0] for f in self.stack] + [label])
            self.totals[path] += seconds - frame[2]
            if self.flops is not None:
                self.flops[path] += flops - frame[4]
            if self.stack:
                self.stack[-1][2] += seconds
                self.stack[-1][4] += flops

    def staged(self, fn, label: str):
        def wrapper(*a, **k):
            for key, inner in KEYWORD_STAGES.items():
                if callable(k.get(key)):
                    k[key] = self.staged(k[key], inner)
            with self.stage(label):
                return fn(*a, **k)
        return wrapper


@contextmanager
def timed(totals: dict, device: torch.device, counter=None, flops: dict | None = None):
    """Every function of ``STAGES`` timed into ``totals`` (its FLOPs into ``flops`` under ``counter``) inside the
    block, by stage path."""
    clock, originals = Clock(totals, device, counter, flops), []
    for module, name, label in STAGES:
        fn = getattr(module, name)
        wrapper = clock.staged(fn, label)
        # modules that imported the function by name hold their own reference
        holders = [module, *(m for key, m in sys.modules.items() if key.startswith("spap_lib.") and m is not module)]
        for other in holders:
            if getattr(other, name, None) is fn:
                originals.append((other, name, fn))
                setattr(other, name, wrapper)
    try:
        yield
    finally:
        for module, name, fn in originals:
            setattr(module, name, fn)


def _cholesky_flops(A, *args, **kwargs) -> int:
    return A[-1] ** 3 // 3


def _triangular_flops(A, B, *args, **kwargs) -> int:
    return A[-1] * A[-1] * B[-1]


def counting():
    """A ``FlopCounterMode`` that counts the matrix products (torch's own formulas) and the factorisations and
    triangular solves of the closed forms."""
    from torch.utils.flop_counter import FlopCounterMode

    aten = torch.ops.aten
    return FlopCounterMode(display=False, custom_mapping={aten.linalg_cholesky_ex: _cholesky_flops,
                                                          aten.linalg_solve_triangular: _triangular_flops})


PEAK_N = 2048


def peak_rates(device: torch.device, n: int = PEAK_N, repeat: int = 5) -> dict[str, float]:
    """The fastest matrix product this device runs, in FLOP/s, in float32 and in bf16 (n × n by n × n, best of
    ``repeat``): the yardstick of each stage's share of the machine."""
    rates = {}
    for name, dtype in (("float32", torch.float32), ("bf16", torch.bfloat16)):
        a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
        torch.mm(a, b)  # warm-up
        best = float("inf")
        for _ in range(repeat):
            synchronize(device)
            t0 = time.perf_counter()
            torch.mm(a, b)
            synchronize(device)
            best = min(best, time.perf_counter() - t0)
        rates[name] = 2 * n ** 3 / best
    return rates


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


def profile(method, problem, device: torch.device, flops: bool) -> tuple:
    """``method`` on a fresh ``problem()``, timed by stage (then, with ``flops``, run again to count its FLOPs;
    on CUDA run again unsynchronised and traced): the result and its rows."""
    totals: dict = defaultdict(float)
    if device.type == "cuda":  # the first call of each kernel loads it: warm up outside the clock
        method.prune(problem())
    synchronize(device)
    t0 = time.perf_counter()
    with timed(totals, device):
        result = method.prune(problem())
    total = time.perf_counter() - t0
    counted: dict = defaultdict(float)
    if flops:  # a second run to count: the counter's dispatch would slow the timed one
        with counting() as counter, timed(defaultdict(float), device, counter, counted):
            method.prune(problem())
    all_flops = counter.get_total_flops() if flops else 0.0
    rows = [{"stage": stage, "seconds": sec, "gflop": counted.get(stage, 0.0) / 1e9} for stage, sec in totals.items()]
    rows.append({"stage": "other (selection, masks, copies)", "seconds": total - sum(totals.values()),
                 "gflop": (all_flops - sum(counted.values())) / 1e9})
    rows.append({"stage": "total", "seconds": total, "gflop": all_flops / 1e9})
    if device.type == "cuda":  # unsynchronised, as a prune runs, and traced
        synchronize(device)
        t0 = time.perf_counter()
        method.prune(problem())
        synchronize(device)
        rows.append({"stage": "total, stages not synchronised", "seconds": time.perf_counter() - t0})
        rows += [{"stage": k, "seconds": v}  # counts, where the stage says so
                 for k, v in traced(lambda: method.prune(problem()), device).items()]
    return result, rows


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
    ap.add_argument("--no-flops", dest="flops", action="store_false",
                    help="skip the second run of each method that counts its FLOPs per stage")
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

            result, stage_rows = profile(method, problem, device, args.flops)
            rows += [{"method": label, **row} for row in stage_rows]
            if name in results:  # the answer against the first setting's
                keep, W = results[name]
                diff = float((result.mlp.W_out - W).abs().max() / W.abs().max()) if torch.equal(result.keep, keep) \
                    else float("nan")
                same.append(f"{label}: " + (f"the same kept channels, largest output-weight difference {diff:.1e} of "
                                            "the largest weight" if diff == diff else "other kept channels"))
            results.setdefault(name, (result.keep, result.mlp.W_out))
            print(label, *(f"{r['stage']} {r['seconds']:.2f} s" for r in stage_rows if r["stage"] == "total"),
                  flush=True)
    frame = pd.DataFrame(rows)
    frame["model"], frame["layer"], frame["tokens"] = args.model, args.layer, args.nsamples * args.seqlen
    write_csv_atomic(args.out, frame)
    header = (f"Command: `{command}`  \nRevision: `{git_revision()}`  \n"
              f"Device: {device_name(device)}{RANDOM_NOTE if args.random else ''}; "
              f"{loaded.model.dtype} weights; layer {args.layer} of {args.model}, "
              f"{args.nsamples} x {args.seqlen} calibration tokens, sparsity {args.sparsity}, hyperparameters as "
              "labelled (the rest default).")
    write_text_atomic(args.out.replace(".csv", ".md"), report(frame, header, same, device, args.flops))


def report(frame: pd.DataFrame, header: str, same: list[str], device: torch.device, flops: bool) -> str:
    """The Markdown twin: seconds by stage and method, each method's ratio to FASP, and (``flops``) the rates."""
    totals = frame[frame["stage"] == "total"].set_index("method")["seconds"]
    wide = frame.pivot_table(index="stage", columns="method", values="seconds", sort=False).round(
        2 if device.type == "cpu" else 4)  # a small layer's stages on a GPU take milliseconds

    def fasp_of(label: str) -> str:  # FASP at the same Gram blocks
        return label.replace(label.split(" [")[0], "fasp", 1)

    ratios = ", ".join(f"{m} {totals[m] / totals[fasp_of(m)]:.1f}x" for m in totals.index if fasp_of(m) in totals)
    blank = wide.astype(object).where(wide.notna(), "")  # a stage the method does not have
    return (f"# One-layer time breakdown\n\n{header}\n\n{markdown_table(blank)}\n\nRatio to FASP: {ratios}\n"
            + "".join(f"\n* {line} (against the first Gram setting)" for line in same) + ("\n" if same else "")
            + (rates_section(frame, peak_rates(device)) if flops else ""))


def rates_section(frame: pd.DataFrame, peaks: dict[str, float]) -> str:
    """Each stage's FLOPs, its rate and that rate's share of the device's fastest float32 and bf16 products."""
    rated = frame[frame["gflop"] > 0].copy()
    rated["GFLOP/s"] = rated["gflop"] / rated["seconds"]
    for name, peak in peaks.items():
        rated[f"% of {name} peak"] = 100 * rated["GFLOP/s"] * 1e9 / peak
    rated = rated.rename(columns={"gflop": "GFLOP"}).drop(columns=["model", "layer", "tokens"]).round(2)
    return (f"\n## FLOPs and rates by stage\n\nFLOPs of the matrix products (torch.utils.flop_counter), the Cholesky "
            f"factorisations (n³/3) and triangular solves (n²k), counted in a second run of each method; the rate "
            f"is over the timed run's seconds. Peaks: the fastest {PEAK_N} × {PEAK_N} product, "
            + ", ".join(f"{k} {v / 1e9:.0f} GFLOP/s" for k, v in peaks.items())
            + ". A stage's rate against the peak of the precision it runs in says how far it is from its limit "
            "(the rounds' products are bf16 by default, the dense pass, the penalty loop and the final refit "
            f"float32).\n\n{markdown_table(rated, index=False)}\n")


if __name__ == "__main__":
    main()
