"""The corruption sweep: every file spap reads back, damaged the ways storage and copies damage files.

Each file of a pruned checkpoint, a resume folder, a run folder's caches and the results table is cut at
several offsets, has a byte flipped at several places, and is deleted; then the entry point that reads it
runs. Each case must be refused in one line naming the file (``SpapError``; exit 2 on the command line),
or give exactly the undamaged run's result (recomputed, or the damage did not touch what the result depends
on). None may succeed with another result. The count is printed and in docs/reliability.md.
"""
from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch
from test_entry_points import TINY, spap

import spap_lib as sl
from spap_lib.errors import SpapError

COUNTS: dict[str, dict[str, int]] = {}
FAST = ["--method", "fasp", "--sparsity", "0.3"]


def damages(path: Path) -> list[str]:
    """The damages of ``path``, as ``_apply_to`` reads them: cuts at several offsets, flipped bytes, deletion."""
    size = path.stat().st_size
    cuts = sorted({0, 1, size // 3, size // 2, size - 1} - {size})
    flips = sorted({0, size // 3, size // 2, max(size - 2, 0)})
    return [f"cut at {n}" for n in cuts] + [f"byte {i} flipped" for i in flips] + ["deleted"]


def sweep(kind: str, folder: Path, files: list[str], run, expected, tmp_path: Path) -> None:
    """Damage each of ``files`` in a fresh copy of ``folder``, call ``run(copy)`` and classify the outcome."""
    counts = COUNTS.setdefault(kind, {"cases": 0, "refused": 0, "recomputed": 0})
    wrong = []
    for name in files:
        for i, what in enumerate(damages(folder / name)):
            copy = tmp_path / f"{kind}-{Path(name).name}-{i}"
            shutil.copytree(folder, copy)
            _apply_to(copy / name, what)
            counts["cases"] += 1
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    got = run(copy)
            except SpapError as err:
                text = str(err)
                if "\n" in text.strip() or not (Path(name).name in text or str(copy) in text):
                    wrong.append(f"{name} {what}: refusal does not name the file in one line: {text[:200]}")
                counts["refused"] += 1
                continue
            if got == "refused":
                counts["refused"] += 1
            elif got != expected:
                wrong.append(f"{name} {what}: succeeded with another result ({str(got)[:120]})")
            else:
                counts["recomputed"] += 1
            shutil.rmtree(copy, ignore_errors=True)
    print(f"\ncorruption sweep, {kind}: {counts['cases']} cases, {counts['refused']} refused, "
          f"{counts['recomputed']} gave the undamaged result")
    assert not wrong, "\n".join(wrong)


def _apply_to(path: Path, what: str) -> None:
    """The damage ``what`` (as ``damages`` names it) applied to ``path``."""
    if what == "deleted":
        path.unlink()
        return
    n = int(what.split()[-1] if what.startswith("cut") else what.split()[1])
    data = bytearray(path.read_bytes())
    if what.startswith("cut"):
        path.write_bytes(bytes(data[:n]))
    else:
        data[n] ^= 0xFF
        path.write_bytes(bytes(data))


def _ours(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def pruned(tmp_path_factory, tiny_tokenizer):
    """A tiny llama checkpoint, its FASP prune through the command, and that prune's resume folder."""
    from conftest import tiny_model

    root = tmp_path_factory.mktemp("sweep")
    source = root / "source"
    tiny_model("llama").save_pretrained(source)
    tiny_tokenizer.save_pretrained(source)
    out = root / "pruned"
    assert spap("prune", source, "--out", out, *FAST, *TINY, "--no-eval").returncode == 0
    return source, out


def _weights(folder: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v.clone() for k, v in load_file(str(folder / "model.safetensors")).items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_damaged_checkpoint_is_refused_or_gives_its_own_perplexity(pruned, tmp_path):
    _, out = pruned
    expected = spap("eval", shutil.copytree(out, tmp_path / "clean"), *TINY[4:]).stdout

    def run(copy):
        result = spap("eval", copy, *TINY[4:])
        if result.returncode == 2:
            assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1, result.stderr
            assert any(Path(n).name in result.stderr for n in _ours(copy) + ["config.json", "tokenizer", "model."]) \
                or str(copy) in result.stderr, result.stderr
            return "refused"
        assert result.returncode == 0, result.stderr[-1500:]
        return result.stdout.replace(str(copy), str(tmp_path / "clean"))
    sweep("checkpoint", out, [n for n in _ours(out) if n != "README.md"], run, expected, tmp_path)


def test_a_damaged_resume_folder_is_refused_or_resumed_to_the_same_weights(pruned, tmp_path, monkeypatch):
    from spap_lib.pipeline import resume

    source, clean_out = pruned
    expected = _weights(clean_out)
    folder = tmp_path / "progress"
    real = resume.LayerCheckpoint.save

    def stop_after_first(self, i, *a, **k):  # a pre-empted job: layer 0 committed, then killed
        real(self, i, *a, **k)
        if i == 0:
            raise KeyboardInterrupt
    monkeypatch.setattr(resume.LayerCheckpoint, "save", stop_after_first)
    with pytest.raises(KeyboardInterrupt):
        spap("prune", source, "--out", tmp_path / "o", *FAST, *TINY, "--no-eval", "--resume-dir", folder)
    monkeypatch.setattr(resume.LayerCheckpoint, "save", real)
    assert sorted(_ours(folder)) == ["hidden_001.bin", "layer_000.safetensors", "state.json"]

    def run(copy):
        out = copy.parent / f"{copy.name}-out"
        result = spap("prune", source, "--out", out, *FAST, *TINY, "--no-eval", "--resume-dir", copy)
        if result.returncode == 2:
            assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1, result.stderr
            assert str(copy) in result.stderr, result.stderr
            return "refused"
        assert result.returncode == 0, result.stderr[-1500:]
        return "same" if _same(_weights(out), expected) else "other weights"
    sweep("resume folder", folder, _ours(folder), run, "same", tmp_path)


def test_damaged_run_folder_caches_are_computed_again(pruned, tmp_path):
    source, _ = pruned
    loaded = sl.load(str(source), device="cpu")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    calib = sl.get_calibration(loaded, 4, 24, 0, cache=run_dir / "calibration.pt")
    dense = sl.dense_perplexity(loaded, 24, 2, cache=run_dir / "dense.json", progress=False)

    def run(copy):
        again = sl.get_calibration(loaded, 4, 24, 0, cache=copy / "calibration.pt")
        ppl = sl.dense_perplexity(loaded, 24, 2, cache=copy / "dense.json", progress=False)
        return (again.windows.tolist(), again.starts.tolist(), ppl["ppl"])
    sweep("run folder caches", run_dir, ["calibration.pt", "dense.json"], run,
          (calib.windows.tolist(), calib.starts.tolist(), dense["ppl"]), tmp_path)


def test_a_damaged_results_table_is_refused_or_its_cells_rerun(tiny_tokenizer, tmp_path):
    from test_grid import _grid

    from spap_lib.artifact.grid import Variant, check_grid, run_grid

    windows = torch.randint(0, 128, (4, 24), generator=torch.Generator().manual_seed(1))
    grid = _grid("llama", tiny_tokenizer, windows)
    variants = [Variant.parse("magnitude"), Variant.parse("wanda_sp")]
    folder = tmp_path / "results"
    clean = run_grid(grid, variants, [0.2, 0.4], [16], 2, folder / "ablation.csv")

    def cells(table):
        return sorted(zip(table["label"], table["sparsity"], table["ppl"].round(10)))

    def run(copy):
        check_grid([0.2, 0.4], [16], copy / "ablation.csv")  # what 03 does before loading any model
        return cells(run_grid(grid, variants, [0.2, 0.4], [16], 2, copy / "ablation.csv"))
    sweep("results table", folder, ["ablation.csv"], run, cells(clean), tmp_path)


def test_the_sweep_counts_are_the_documented_ones():
    """docs/reliability.md states the sweep's size; a change to the sweep updates it."""
    if len(COUNTS) < 4:
        pytest.skip("the sweep's four tests did not all run in this pytest run")
    total = {k: sum(c[k] for c in COUNTS.values()) for k in ("cases", "refused", "recomputed")}
    text = (Path(__file__).resolve().parent.parent / "docs" / "reliability.md").read_text()
    line = f"{total['cases']} cases: {total['refused']} refused, {total['recomputed']} gave the undamaged result"
    print("\ncorruption sweep, all:", line)
    assert line in text, line
