"""Every GPU figure of the docs from one prepared, resumable command: ``make gpu-check``.

On one GPU, in this order (each step's rows are written as they finish; a second call resumes after them):

1. ``pytest -m gpu`` (with a bf16 and an fp16 hub-cache checkpoint pruned in bfloat16 at every offload and saved
   in its own dtype);
2. single decoder layers on random weights of the shipped configs' shapes (no model files) at 128 x 2048
   calibration tokens, each in its own process (its host peak its own): a LLaMA-3.1-8B layer with SPAP and FASP,
   resident and ``offload=cpu``, and a LLaMA-3.1-70B layer with SPAP and ``offload=cpu``, all under a 24 GB cap
   (``torch.cuda.set_per_process_memory_fraction``); a Qwen2.5-0.5B layer with SPAP and FASP side by side.
   Seconds by stage, device and host peaks, and the plan's prediction beside each, marked where the time is
   outside +-30 % or the device memory outside +-10 % of it;
3. the decode profile (``05_profile``'s path: static cache and compiled step on CUDA) of 8B shapes, dense
   against 10/20/30 % sparsity, with the bytes bound beside each;
4. a heal (``spap_lib.heal``) of Qwen2.5-0.5B's shapes pruned by 20 %, from the dense model, on random tokens:
   tokens per second and the device peak beside the plan's.

Writes CSV files and ``summary.md`` (device, torch, CUDA, revision) into ``--out`` and prints the summary last.

    make gpu-check                 # bench/results/gpu_check_<device>/
    make gpu-check DRY=1           # the same steps on tiny shapes on this machine (build/gpu_check_dry/)
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd
import torch
from common import random_calibration, random_checkpoint  # bench/, the script's own folder

import spap_lib as sl
from spap_lib.artifact.figures import markdown_table
from spap_lib.artifact.manifest import device_name, git_revision
from spap_lib.files import REPO, write_csv_atomic, write_text_atomic
from spap_lib.model.loading import pick_device
from spap_lib.numerics.memory import peak_rss_mb
from spap_lib.plan import local_device, plan

GB = 2**30
TIME_BAND, MEMORY_BAND = 0.30, 0.10  # a measured row further than this from the plan is marked
# Seconds the plan does not price, for the wall-time estimate (docs/scale.md): a process's imports and CUDA start,
# a one-layer checkpoint's load, a decode variant's load and compile, ``pytest -m gpu``, and the first build of the
# random checkpoints (kept in bench/.cache: a second call reuses them), and the heal step's two loads and its steps.
PROCESS_S, DECODE_VARIANT_S, PYTEST_S, BUILD_S, HEAL_S = 20, 45, 60, 60, 90


@dataclass(frozen=True)
class Case:
    """One measured layer: the shipped config whose shapes it has, the method, the offload and the device cap."""
    name: str
    alias: str
    method: str
    offload: str
    cap_gb: float | None


CASES = (Case("8b spap resident", "llama-3.1-8b", "spap", "none", 24),
         Case("8b fasp resident", "llama-3.1-8b", "fasp", "none", 24),
         Case("8b spap offload=cpu", "llama-3.1-8b", "spap", "cpu", 24),
         Case("8b fasp offload=cpu", "llama-3.1-8b", "fasp", "cpu", 24),
         Case("70b spap offload=cpu", "llama-3.1-70b", "spap", "cpu", 24),
         Case("qwen0.5b spap", "qwen2.5-0.5b", "spap", "none", None),
         Case("qwen0.5b fasp", "qwen2.5-0.5b", "fasp", "none", None))


@dataclass(frozen=True)
class Sizes:
    """How big the run is: the paper's calibration on a GPU, tiny shapes for ``--dry``."""
    nsamples: int
    seqlen: int
    decode_layers: int  # decoder layers of the model the decode profile generates with
    new_tokens: int

    @classmethod
    def of(cls, dry: bool) -> Sizes:
        return cls(4, 64, 2, 8) if dry else cls(128, 2048, 8, 256)


# --dry: the same architectures at a width of 64
TINY = {"hidden_size": 64, "intermediate_size": 160, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 32, "vocab_size": 512, "tie_word_embeddings": False}


def checkpoint(alias: str, layers: int, device: torch.device, dry: bool) -> Path:
    """Random weights of ``alias``'s shapes (``--dry``: shrunk to ``TINY``)."""
    return random_checkpoint(alias, layers, device, TINY if dry else None)


def measure_layer(case: Case, sizes: Sizes, dry: bool) -> dict:
    """One layer of ``case``, in this process: the plan first, then the prune with its stages timed."""
    from profile_layer import timed  # the stage clock of bench/profile_layer.py

    device = pick_device("auto")
    row_name, memory = local_device(device)
    cap = case.cap_gb if device.type == "cuda" else None  # a CPU run has no device to cap
    if cap:
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap * GB / total), device)
    path = checkpoint(case.alias, 1, device, dry)
    # no perplexity is measured here: a two-token evaluation keeps the plan's peak the prune's own
    p = plan(str(path), method=case.method, nsamples=sizes.nsamples, seqlen=sizes.seqlen, eval_seqlen=2,
             eval_windows=1, device=row_name, device_memory_gb=cap or memory, offload=case.offload)
    loaded = sl.load(str(path), device=str(device), offload=case.offload, spill_dir=tempfile.mkdtemp())
    calib = random_calibration(loaded.model.config.vocab_size, sizes.nsamples, sizes.seqlen, seed=0)
    stages: dict = defaultdict(float)
    with timed(stages, device):
        report = sl.prune(loaded, calib, case.method, 0.2, progress=False)
    mem = report["memory"]
    device_gb = mem.get("cuda_peak_mb", float("nan")) / 1024
    row = {**asdict(case), "seconds": report["seconds"], "plan seconds": p.prune_seconds,
           "device peak GB": device_gb, "plan device GB": p.peak_device_gb,
           "host peak GB": peak_rss_mb() / 1024, "plan host GB": p.peak_host_gb,
           "plan fits": p.fits, **{f"s: {k}": v for k, v in stages.items()}}
    row["outside band"] = _outside(row)
    return row


def _outside(row: dict) -> str:
    """What of a measured row lies outside the plan's band (empty: within it)."""
    marks = []
    if row["plan seconds"] > 0 and abs(row["seconds"] / row["plan seconds"] - 1) > TIME_BAND:
        marks.append(f"time {row['seconds'] / row['plan seconds']:.2f}x plan")
    if row["device peak GB"] == row["device peak GB"] and row["plan device GB"] > 0 and \
            abs(row["device peak GB"] / row["plan device GB"] - 1) > MEMORY_BAND:
        marks.append(f"device memory {row['device peak GB'] / row['plan device GB']:.2f}x plan")
    return "; ".join(marks)


def decode_rows(sizes: Sizes, dry: bool) -> list[dict]:
    """The decode profile of 8B shapes, dense and 10/20/30 %: the first channels kept in every layer (the
    timing depends on the widths, not on which channels). ``--dry``: dense and 20% (each variant is a fresh process
    on a CPU)."""
    from spap_lib.evaluation.profile import Variant, profile_rounds, summary_table

    device = pick_device("auto")
    path = checkpoint("llama-3.1-8b", sizes.decode_layers, device, dry)
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):  # shapes only, for the kept widths
        config = AutoConfig.from_pretrained(path, trust_remote_code=False)
        adapter = sl.get_adapter(AutoModelForCausalLM.from_config(config))
    variants = {"dense": Variant(str(path))}
    for s in (0.2,) if dry else (0.1, 0.2, 0.3):
        p = sl.plan_sparsity(adapter, s)
        kept = [list(range(p.width - p.n_remove))] * p.layers
        variants[f"{s:.0%}"] = Variant(str(path), kept, p.n_remove * p.layers * p.params_per_channel / p.decoder_params)
    results = profile_rounds(variants, device=str(device), new_tokens=sizes.new_tokens, repeats=2, warmup=1)
    table = summary_table("llama-3.1-8b shapes", "channels", variants, results, sizes.new_tokens)
    return table.to_dict("records")


def heal_rows(sizes: Sizes, dry: bool) -> list[dict]:
    """A heal of Qwen2.5-0.5B's shapes (``--dry``: tiny, two layers) pruned by 20 % (magnitude: which channels go
    does not change the time), from its dense model, on random windows: its time and peak beside the plan's."""
    from spap_lib.heal import HealWindows
    from spap_lib.heal import distill as kd
    from spap_lib.settings import HealConfig

    device = pick_device("auto")
    layers = 2 if dry else 24
    path = checkpoint("qwen2.5-0.5b", layers, device, dry)
    cfg = HealConfig(tokens=4 * 128 if dry else 64 * 4 * 512, seqlen=128 if dry else 512, batch=4)
    p = plan(str(path), method="magnitude", nsamples=1, seqlen=2, eval_seqlen=2, eval_windows=1,
             device=local_device(device)[0], offload="none", heal=cfg)
    student, teacher = (sl.load(str(path), device=str(device)) for _ in range(2))
    sl.prune(student, random_calibration(student.model.config.vocab_size, 2, 16, seed=0), "magnitude", 0.2,
             progress=False)
    vocab = student.model.config.vocab_size
    windows = HealWindows(torch.randint(0, vocab, (64, cfg.seqlen), generator=torch.Generator().manual_seed(0)),
                          "random tokens", "random", 0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    report = kd.distill(student, teacher.model.requires_grad_(False), windows, cfg, progress=False)
    peak = torch.cuda.max_memory_allocated(device) / GB if device.type == "cuda" else float("nan")
    return [{"name": f"heal qwen0.5b shapes, {layers} layers", "tokens": report["tokens"],
             "seconds": report["seconds"], "tokens_per_s": report["tokens_per_s"], "precision": report["precision"],
             "plan seconds": p.seconds["healing"], "device peak GB": peak, "plan heal GB": sum(p.heal_gb.values())}]


def pytest_rows() -> list[dict]:
    t0 = time.perf_counter()
    # the tests that need CUDA live in tests/test_gpu.py: collecting only it keeps the dry run short
    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                           "tests/test_gpu.py"],
                          cwd=REPO, capture_output=True, text=True)
    last = (proc.stdout.strip().splitlines() or ["no output"])[-1]
    return [{"command": "pytest -m gpu", "exit status": proc.returncode, "result": last,
             "seconds": round(time.perf_counter() - t0, 1)}]


def _revision() -> str:
    """The rows' revision: a checkout's commit, or a label where there is no git history (the Docker image), which
    pandas reads back as text, not as a missing value."""
    return git_revision() or "no-git-revision"


def _done(path: Path, key: str) -> set[str]:
    """Rows of an earlier call at this revision: not measured again."""
    if not path.is_file():
        return set()
    table = pd.read_csv(path)
    return set(table.loc[table["revision"] == _revision(), key].astype(str))


def _append(path: Path, rows: list[dict]) -> None:
    old = pd.read_csv(path) if path.is_file() else pd.DataFrame()
    write_csv_atomic(path, pd.concat([old, pd.DataFrame(rows).assign(revision=_revision())], ignore_index=True))


def estimate(sizes: Sizes, device_row: str) -> float:
    """Wall seconds of a whole call: the plan's prune time of every case plus what the plan does not price."""
    from spap_lib.plan import shipped_config

    prune = sum(plan(c.alias, method=c.method, nsamples=sizes.nsamples, seqlen=sizes.seqlen, device=device_row,
                     device_memory_gb=c.cap_gb, offload=c.offload).prune_seconds
                / shipped_config(c.alias).num_hidden_layers for c in CASES)
    return PYTEST_S + BUILD_S + prune + PROCESS_S * len(CASES) + DECODE_VARIANT_S * 4 + HEAL_S


def _child_case(case: Case, dry: bool) -> dict:
    """``measure_layer`` in a process of its own (``--case``): its row."""
    child = [sys.executable, __file__, "--case", case.name, *(["--dry"] if dry else [])]
    proc = subprocess.run(child, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"{case.name} failed (rerun to resume after the rows already written)")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_steps(out: Path, dry: bool, argv: list[str]) -> None:
    sizes = Sizes.of(dry)
    out.mkdir(parents=True, exist_ok=True)
    if not dry:
        print(f"estimated wall time on {local_device(pick_device('auto'))[0]}: about "
              f"{estimate(sizes, local_device(pick_device('auto'))[0]) / 60:.0f} min (docs/scale.md)", flush=True)
    if "pytest -m gpu" not in _done(out / "pytest.csv", "command"):
        _append(out / "pytest.csv", pytest_rows())
    layers = out / "layers.csv"
    for i, case in enumerate(CASES):
        if case.name in _done(layers, "name"):
            print(f"{case.name}: measured already at this revision", flush=True)
            continue
        checkpoint(case.alias, 1, pick_device("auto"), dry)  # built here: the child's host peak is the prune's
        # each case in a process of its own, for its host peak; a dry run's tiny rows are no figures, so after the
        # first (the child's path proved) they run in this process and spare a start each
        row = measure_layer(case, sizes, dry) if dry and i > 0 else _child_case(case, dry)
        _append(layers, [row])
        print(f"{case.name}: {row['seconds']:.2f} s (plan {row['plan seconds']:.2f} s) {row['outside band']}",
              flush=True)
    if not _done(out / "decode.csv", "variant"):
        _append(out / "decode.csv", decode_rows(sizes, dry))
    if not _done(out / "heal.csv", "name"):
        _append(out / "heal.csv", heal_rows(sizes, dry))
    write_text_atomic(out / "summary.md", summary(out, sizes, dry, argv))
    print((out / "summary.md").read_text())


def summary(out: Path, sizes: Sizes, dry: bool, argv: list[str]) -> str:
    device = pick_device("auto")
    now = {name: pd.read_csv(out / f"{name}.csv").query("revision == @_revision()")
           for name in ("pytest", "layers", "decode", "heal")}
    shown = ["name", "seconds", "plan seconds", "device peak GB", "plan device GB", "host peak GB", "plan host GB",
             "outside band"]
    decode = ["variant", "sparsity", "decode", "decode_ms_per_token", "tokens_per_s", "speedup", "bytes_bound",
              "peak_mem_mb"]
    return (f"# GPU check{' (dry run: tiny shapes, not figures)' if dry else ''}\n\n"
            f"Command: `python bench/gpu_check.py {' '.join(argv)}`  \nRevision: `{git_revision()}`  \n"
            f"Device: {device_name(device)}; torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}  \n"
            f"Calibration {sizes.nsamples} x {sizes.seqlen} random tokens on random weights of the configs' shapes; "
            f"time band +-{TIME_BAND:.0%}, memory band +-{MEMORY_BAND:.0%} of the plan.\n\n"
            f"`pytest -m gpu`: {now['pytest'].iloc[-1]['result']}\n\n## One decoder layer\n\n"
            f"{markdown_table(now['layers'][shown].round(3), index=False)}\n\n"
            f"## Decode ({sizes.decode_layers} layers of LLaMA-3.1-8B's shapes, {sizes.new_tokens} new tokens)\n\n"
            f"{markdown_table(now['decode'][[c for c in decode if c in now['decode']]].round(3), index=False)}\n\n"
            f"## Healing\n\n{markdown_table(now['heal'].drop(columns='revision').round(3), index=False)}\n")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry", action="store_true", help="tiny shapes: proves the script on a CPU in two minutes")
    ap.add_argument("--out", default=None, help="result folder (default: bench/results/gpu_check_<device>, or "
                    "build/gpu_check_dry with --dry)")
    ap.add_argument("--case", help=argparse.SUPPRESS)  # the child process of one layer case
    args = ap.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    if args.case:
        case = next(c for c in CASES if c.name == args.case)
        print(json.dumps(measure_layer(case, Sizes.of(args.dry), args.dry), default=float), flush=True)
        return
    device = pick_device("auto")
    if device.type != "cuda" and not args.dry:
        raise SystemExit("gpu_check measures a GPU and this machine has none: pass --dry (make gpu-check DRY=1) "
                         "to run its steps on tiny shapes here")
    slug = local_device(device)[0] if not args.dry else "dry"
    out = Path(args.out) if args.out else (REPO / "build" / "gpu_check_dry" if args.dry
                                           else REPO / "bench" / "results" / f"gpu_check_{slug}")
    run_steps(out, args.dry, argv)


if __name__ == "__main__":
    main()
