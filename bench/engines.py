"""The pruned model in llama.cpp: quality, file size and speed of dense and pruned checkpoints on the CPU.

Each checkpoint is made by ``spap prune`` (dense: sparsity 0), converted by llama.cpp's own converter and quantized
by llama.cpp (``spap_lib.artifact.llamacpp``). For every file:
- perplexity through llama.cpp on the first ``--eval-windows`` test windows of WikiText-2, fed the token ids spap's
  own evaluation reads, beside transformers' perplexity of the checkpoint on the same windows (float32);
- greedy agreement: the share of ``--agree-tokens`` greedy tokens after each of ``--agree-prompts`` test prompts
  that llama.cpp produces exactly as transformers does, up to the first difference;
- prompt tokens/s (one batch of ``--prompt-tokens``) and decode tokens/s (``--decode-tokens`` single-token steps
  after it, fed the text's next tokens: the speed of a step does not depend on which token it is) at ``--threads``.
Speed: every file is open at once and timed in turn, the order rotated each repeat, ``--repeats`` times; the
rows give medians, the ratio to the dense file of the same quantization, and the bytes bound (dense file size
over this file's: decode reads every weight once per token).

    make setup-engines && make engines      # the committed table: results/llamacpp.csv (+ .manifest.json)
    make engines-round-to                   # round_to 0/32/64/256 on both models: results/llamacpp_round_to.csv

A table holds one run per model: ``--out`` keeps the rows of the other models it holds and replaces this one's.

Resumable: checkpoints, GGUF files and per-file quality land in ``--run`` and are reused when their recorded
settings match; the speed runs are always measured together.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd

from spap_lib.artifact import llamacpp
from spap_lib.artifact.engines import COLUMNS, check_table, with_model
from spap_lib.artifact.manifest import cpu_name, read_checkpoint_manifest, write_manifest
from spap_lib.files import write_csv_atomic, write_json_atomic


@dataclass(frozen=True)
class Settings:
    model: str = "smollm2-135m"
    method: str = "spap"
    sparsities: tuple = (0.1, 0.2, 0.3)
    round_tos: tuple = (0, 64)  # 0: the method's own widths
    quants: tuple = ("f16", "q8_0", "q4_k_m")
    nsamples: int = 32  # the grid's calibration protocol (results/ablation.csv)
    seqlen: int = 512
    eval_seqlen: int = 512
    eval_windows: int = 10
    threads: int = 2
    repeats: int = 5
    prompt_tokens: int = 512
    decode_tokens: int = 128
    agree_prompts: int = 8
    agree_tokens: int = 32
    repack: str = "auto"  # llama.cpp's repacked weights: on, off, auto (off on AMX CPUs: llamacpp.amx)

    @property
    def repacks(self) -> bool:
        if self.repack not in ("on", "off", "auto"):
            raise SystemExit(f"--repack {self.repack}: expected on, off or auto")
        return {"on": True, "off": False}.get(self.repack, not llamacpp.amx())


def cells(s: Settings) -> dict[str, tuple[str, float, int]]:
    """{name: (method, sparsity, round_to)}: the dense model (sparsity 0 saves it unchanged, whatever the method;
    magnitude reads no calibration), then every sparsity at every rounding."""
    named = {"dense": ("magnitude", 0.0, 0)}
    for sparsity in s.sparsities:
        for r in s.round_tos:
            named[f"{s.method}-{round(sparsity * 100)}" + (f"-r{r}" if r else "")] = (s.method, sparsity, r)
    return named


def checkpoint(s: Settings, run: Path, name: str, cell: tuple[str, float, int], tokenizer: str) -> Path:
    """The cell's checkpoint, made by ``spap prune`` unless one made with the same request and the same tokenizer
    (``keys.tokenizer_digest`` of the source's, as ``sl.load`` builds it) is in ``run``."""
    method, sparsity, round_to = cell
    folder = run / "checkpoints" / name
    want = {"model": s.model, "method": method, "requested": sparsity, "round_to": round_to or None,
            "nsamples": s.nsamples, "seqlen": s.seqlen, "tokenizer": tokenizer}
    found = read_checkpoint_manifest(folder)
    if found and {"model": found["model"]["name"], "method": found["method"],
                  "requested": found["sparsity"]["requested"], "round_to": found["sparsity"]["round_to"],
                  "nsamples": found["calibration"]["nsamples"], "seqlen": found["calibration"]["seqlen"],
                  "tokenizer": found.get("checks", {}).get("tokenizer")} == want:
        return folder
    cmd = [sys.executable, "-m", "spap_lib.cli", "prune", s.model, "--method", method, "--sparsity", str(sparsity),
           "--nsamples", str(s.nsamples), "--seqlen", str(s.seqlen), "--no-eval", "--overwrite", "--device", "cpu",
           "--out", str(folder), "--round-to", str(round_to or "none")]
    print(" ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True)
    return folder


def gguf_files(s: Settings, run: Path, name: str, folder: Path) -> dict[str, Path]:
    """{quant: file}: the checkpoint converted to f16 and quantized from it, each made once per checkpoint (a file
    older than its checkpoint's manifest is made again)."""
    made = (folder / "spap_manifest.json").stat().st_mtime
    out, f16 = {}, run / "gguf" / f"{name}.f16.gguf"
    for quant in s.quants:
        path = run / "gguf" / f"{name}.{quant}.gguf"
        if not path.is_file() or path.stat().st_mtime < made:
            if not f16.is_file() or f16.stat().st_mtime < made:
                llamacpp.to_gguf(folder, f16)
            if quant != "f16":
                llamacpp.quantize(f16, path, quant, s.threads)
        out[quant] = path
    return out


def cached(path: Path, key: dict, compute) -> dict:
    """``compute()``'s result, kept in ``path`` beside the ``key`` it was computed under and reused for that key
    only; a damaged file is computed again."""
    try:
        old = json.loads(path.read_text()) if path.is_file() else None
    except ValueError:
        old = None
    if isinstance(old, dict) and old.get("key") == key:
        return old
    out = {"key": key, **compute()}
    write_json_atomic(path, out)
    return out


def fed(s: Settings, ids, prompts) -> dict:
    """What every quality number is computed from: the settings and a digest of the token ids (another tokenizer's
    ids are another measurement)."""
    import hashlib

    digest = hashlib.sha256(ids.numpy().tobytes())
    for p in prompts:
        digest.update(p.numpy().tobytes())
    return {"eval_seqlen": s.eval_seqlen, "eval_windows": s.eval_windows, "agree_prompts": s.agree_prompts,
            "agree_tokens": s.agree_tokens, "ids_sha256": digest.hexdigest()[:16]}


def transformers_reference(s: Settings, folder: Path, ids, prompts) -> dict:
    """transformers' perplexity of the checkpoint on the windows and its greedy tokens after each prompt (float32,
    the checkpoint's own reload), cached beside the checkpoint with what it was computed from."""
    def compute():
        import torch

        import spap_lib as sl

        loaded = sl.load(str(folder), device="cpu", dtype="float32")
        ppl = sl.perplexity_of_ids(loaded.model, ids, s.eval_seqlen, s.eval_windows, progress=False)["ppl"]
        with torch.no_grad():
            greedy = [loaded.model.generate(p[None], max_new_tokens=s.agree_tokens, do_sample=False,
                                            min_new_tokens=s.agree_tokens)[0, len(p):].tolist() for p in prompts]
        return {"ppl": ppl, "greedy": greedy}

    return cached(folder / "engines_reference.json", fed(s, ids, prompts), compute)


def engine_quality(s: Settings, path: Path, ids, prompts) -> dict:
    """llama.cpp's perplexity on the windows and its greedy tokens after each prompt, cached beside the file."""
    def compute():
        import numpy as np

        llm = llamacpp.open_model(path, s.eval_seqlen, s.threads, logits_all=True, repack=s.repacks)
        losses = []
        for i in range(s.eval_windows):
            window = ids[i * s.eval_seqlen:(i + 1) * s.eval_seqlen].tolist()
            llm.reset()
            llm.eval(window)
            logits = np.asarray(llm.scores[:s.eval_seqlen - 1], dtype=np.float64)
            top = logits.max(axis=1, keepdims=True)
            logz = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
            losses.append(float(np.mean(logz - logits[np.arange(s.eval_seqlen - 1), window[1:]])))
        greedy = []
        for prompt in prompts:
            llm.reset()
            llm.eval(prompt.tolist())
            tokens = []
            for _ in range(s.agree_tokens):
                tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
                llm.eval([tokens[-1]])
            greedy.append(tokens)
        return {"ppl": float(np.exp(np.mean(losses))), "greedy": greedy}

    return cached(path.with_suffix(".quality.json"), {**fed(s, ids, prompts), "file_mtime": path.stat().st_mtime},
                  compute)


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """The mean share of greedy tokens that agree before the first difference."""
    def prefix(x, y):
        return next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x))
    return statistics.mean(prefix(x, y) / len(x) for x, y in zip(a, b))


def speeds(s: Settings, paths: dict[tuple, Path], ids) -> dict[tuple, dict]:
    """Median prompt and decode tokens/s of every file, all open at once and timed in turn, the order rotated."""
    prompt, follow = ids[:s.prompt_tokens].tolist(), ids[s.prompt_tokens:s.prompt_tokens + s.decode_tokens].tolist()
    llms = {k: llamacpp.open_model(p, s.prompt_tokens + s.decode_tokens, s.threads, logits_all=False, repack=s.repacks)
            for k, p in paths.items()}
    keys, times = list(llms), {k: {"prompt": [], "decode": []} for k in llms}
    for rep in range(s.repeats):
        for k in keys[rep % len(keys):] + keys[:rep % len(keys)]:
            llm = llms[k]
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(prompt)
            t1 = time.perf_counter()
            for token in follow:
                llm.eval([token])
            t2 = time.perf_counter()
            times[k]["prompt"].append(len(prompt) / (t1 - t0))
            times[k]["decode"].append(len(follow) / (t2 - t1))
        print(f"speed: repeat {rep + 1}/{s.repeats} done", flush=True)
    return {k: {m: statistics.median(v) for m, v in t.items()} for k, t in times.items()}


def rows(s: Settings, made: dict, quality: dict, speed: dict) -> pd.DataFrame:
    """One row per checkpoint and quantization (``spap_lib.artifact.engines.COLUMNS``)."""
    out = []
    for (name, quant), path in made["files"].items():
        found, ref = made["manifests"][name], made["references"][name]
        dense_key, q, sp = ("dense", quant), quality[(name, quant)], speed[(name, quant)]
        width = found["sparsity"]["mlp_width"]["pruned"] if found.get("sparsity") else None
        out.append({
            "model": s.model, "label": name, "method": "dense" if name == "dense" else s.method,
            "sparsity": made["cells"][name][1], "round_to": made["cells"][name][2],
            "achieved_sparsity": found["sparsity"]["achieved_decoder"], "mlp_width": width, "quant": quant,
            "file_mb": path.stat().st_size / 1e6, "eval_seqlen": s.eval_seqlen, "eval_windows": s.eval_windows,
            "ppl_llamacpp": q["ppl"], "ppl_transformers": ref["ppl"],
            "greedy_agreement": agreement(q["greedy"], ref["greedy"]),
            "prompt_tps": sp["prompt"], "decode_tps": sp["decode"],
            "prompt_ratio": sp["prompt"] / speed[dense_key]["prompt"],
            "decode_ratio": sp["decode"] / speed[dense_key]["decode"],
            "bytes_bound": made["files"][dense_key].stat().st_size / path.stat().st_size,
            "threads": s.threads, "repeats": s.repeats, "repack": s.repacks, "engine": llamacpp.ENGINE,
            "engine_version": llamacpp.ENGINE_VERSION, "cpu": cpu_name()})
    return pd.DataFrame(out, columns=COLUMNS)


def measure(s: Settings, run: Path) -> pd.DataFrame:
    import spap_lib as sl
    from spap_lib.evaluation.data import tokenize
    from spap_lib.keys import tokenizer_digest
    from spap_lib.model.loading import load_tokenizer

    llamacpp.engine(), llamacpp.converter()  # refused in one line before any prune
    made = {"cells": cells(s), "files": {}, "manifests": {}, "references": {}}
    source = tokenizer_digest(load_tokenizer(sl.resolve(s.model)))
    folders = {name: checkpoint(s, run, name, cell, source) for name, cell in made["cells"].items()}
    tokenizer = sl.load(str(folders["dense"]), device="cpu").tokenizer
    ids = tokenize(tokenizer, sl.wikitext("test").text)
    prompts = [ids[i * s.eval_seqlen:i * s.eval_seqlen + 64] for i in range(s.agree_prompts)]
    for name, folder in folders.items():
        made["manifests"][name] = read_checkpoint_manifest(folder)
        made["references"][name] = transformers_reference(s, folder, ids, prompts)
        made["files"].update({(name, q): p for q, p in gguf_files(s, run, name, folder).items()})
    quality = {k: engine_quality(s, p, ids, prompts) for k, p in made["files"].items()}
    return rows(s, made, quality, speeds(s, made["files"], ids))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for field, default in asdict(Settings()).items():
        kind = type(default[0]) if isinstance(default, tuple) else type(default)
        ap.add_argument(f"--{field.replace('_', '-')}", type=kind, default=default,
                        nargs="+" if isinstance(default, tuple) else None)
    ap.add_argument("--run", default="runs/engines", help="checkpoints, GGUF files and per-file results")
    ap.add_argument("--out", default="results/llamacpp.csv")
    args = vars(ap.parse_args(argv))
    run, out = Path(args.pop("run")), Path(args.pop("out"))
    s = Settings(**{k: tuple(v) if isinstance(v, list) else v for k, v in args.items()})
    table = measure(s, run)
    whole = with_model(out, table)
    write_csv_atomic(out, whole)
    check_table(out)
    build, manifest = Path(llamacpp.ENGINE_DIR / "build_seconds.txt"), out.with_suffix(".manifest.json")
    command = " ".join(["python", "bench/engines.py", *(sys.argv[1:] if argv is None else argv)])
    # every model's own run: the one just made replaces its model's, the others' are kept as the table keeps them
    runs = json.loads(manifest.read_text()).get("runs", {}) if manifest.is_file() else {}
    runs = {m: r for m, r in runs.items() if m in set(whole["model"])}
    runs[s.model] = {"command": command, "settings": asdict(s), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_manifest(manifest, command=command, settings=asdict(s), runs=runs,
                   engine={"name": llamacpp.ENGINE, "version": llamacpp.ENGINE_VERSION,
                           "build_seconds": float(build.read_text()) if build.is_file() else None})
    print(table.round(3).to_string(index=False))


if __name__ == "__main__":
    main()
