"""Records that others write too: a checkpoint's manifest and card (the user edits the card; ``spap eval`` appends;
``spap prune --overwrite`` replaces the folder), the results tables, the digest cache and resume folders.

The concurrency sweep runs, for each such record, two writers at once, and a writer beside a reader or beside a
replacement of the folder, in separate processes; it counts the cases and prints the count (docs/reliability.md).
None may lose an entry or record a result against a model other than the one measured.
"""
from __future__ import annotations

import json
import multiprocessing
import shutil
import subprocess
from pathlib import Path

import pytest
from test_cli import TINY
from test_entry_points import refused, spap

from spap_lib.artifact import card, manifest
from spap_lib.artifact.checkpoint import add_evaluation, checkpoint_digests
from spap_lib.artifact.manifest import MANIFEST
from spap_lib.artifact.table import add_rows, read
from spap_lib.files import atomic_dir, write_json_atomic, write_text_atomic
from spap_lib.keys import file_digest, folder_digests

WRITES = 12  # per writer: enough interleavings on two cores, a second or two per case
FORK = multiprocessing.get_context("fork")  # the workers only write files: no threads of torch's are involved


def _run(*workers) -> list:
    """Each ``(function, args)`` in a process of its own, started together; their results in order."""
    with FORK.Pool(len(workers)) as pool:
        pending = [pool.apply_async(f, args) for f, args in workers]
        return [p.get(timeout=120) for p in pending]


def _fake_checkpoint(folder: Path, weights: bytes) -> Path:
    """A spap checkpoint's records around ``weights``: the manifest with its files' digests, and the card."""
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(weights)
    fields = {"model": {"name": "src", "kind": "dir", "path": "/no/such/source"}, "method": "magnitude",
              "card": {"base_model": "src", "license": "mit"}, "sparsity": {"requested": 0.2},
              "spap_checkpoint": {"format": 1, "files": ["model.safetensors"],
                                  "digests": folder_digests(folder, memo=False)}}
    write_json_atomic(folder / MANIFEST, fields)
    write_text_atomic(folder / card.CARD, card.render(fields))
    return folder


def _evaluate(folder: str, digests: dict, tag: str) -> list[str | None]:
    return [add_evaluation(folder, {"task": "t", "value": float(i), "command": f"{tag}-{i}"}, digests)
            for i in range(WRITES)]


def _replace(target: str, sources: list[str]) -> int:
    """Install each source at ``target`` in turn, as ``spap prune --overwrite`` does; count, before each, the
    evaluations that the installed checkpoint records against another model."""
    wrong = 0
    for i in range(WRITES):
        wrong += _misattributed(Path(target))
        with atomic_dir(target, records=True) as tmp:
            for f in Path(sources[i % len(sources)]).iterdir():
                shutil.copy(f, tmp / f.name)
    return wrong


def _misattributed(folder: Path) -> int:
    fields = json.loads((folder / MANIFEST).read_text())
    own = _model(fields["spap_checkpoint"]["digests"])
    return sum(e.get("model") != own for e in fields.get("evaluations", []))


def _model(digests: dict) -> str:
    import hashlib

    return "sha256:" + hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()[:24]


def _read_records(folder: str) -> int:
    """Read the manifest and the card while they are written: each read is whole (valid JSON, both markers)."""
    bad = 0
    for _ in range(WRITES * 4):
        try:
            json.loads((Path(folder) / MANIFEST).read_text())
            text = (Path(folder) / card.CARD).read_text()
            bad += not (card.BEGIN in text and card.END in text)
        except (OSError, ValueError):
            bad += 1
    return bad


def _add_rows(path: str, tag: str) -> None:
    for i in range(WRITES):
        add_rows(path, [{"writer": tag, "i": i, "value": i * 0.5}], key=("writer", "i"))


def _read_table(path: str) -> int:
    bad = 0
    for _ in range(WRITES * 4):
        try:
            read(path)
        except Exception:  # noqa: BLE001 - any failure to read the table whole is what is counted
            bad += 1
    return bad


def _digests(folder: str, tag: str) -> None:
    for i in range(WRITES):
        f = Path(folder) / f"{tag}-{i}.bin"
        f.write_bytes(f"{tag}{i}".encode() * 64)
        file_digest(f, memo_above=0)  # every file goes through the shared record


def test_the_concurrency_sweep_loses_nothing_and_misattributes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPAP_CACHE_DIR", str(tmp_path / "cache"))
    cases, lost, wrong = 0, 0, 0

    # a checkpoint's manifest and card: two evaluations recorded at once, then beside a reader
    ckpt = _fake_checkpoint(tmp_path / "ckpt", b"weights of x")
    digests = checkpoint_digests(ckpt)
    assert _run((_evaluate, (str(ckpt), digests, "a")), (_evaluate, (str(ckpt), digests, "b"))) == [[None] * WRITES] * 2
    _, unreadable = _run((_evaluate, (str(ckpt), digests, "c")), (_read_records, (str(ckpt),)))
    fields = json.loads((ckpt / MANIFEST).read_text())
    text = (ckpt / card.CARD).read_text()
    commands = {e["command"] for e in fields["evaluations"]}
    lost += 3 * WRITES - len(commands) + sum(f"`{c}`" not in text for c in commands) + unreadable
    wrong += _misattributed(ckpt)
    cases += 2

    # ... beside the folder's replacement by other checkpoints (``spap prune --overwrite``)
    other = _fake_checkpoint(tmp_path / "other", b"weights of y")
    same = _fake_checkpoint(tmp_path / "same", b"weights of x")
    results, replaced_wrong = _run((_evaluate, (str(ckpt), digests, "d")),
                                   (_replace, (str(ckpt), [str(other), str(same)])))
    wrong += replaced_wrong + _misattributed(ckpt)
    assert all(r is None or "was replaced while it was evaluated" in r for r in results)
    cases += 1

    # the results tables: two writers, then a writer beside a reader
    table = tmp_path / "results.csv"
    _run((_add_rows, (str(table), "a")), (_add_rows, (str(table), "b")))
    _, unreadable = _run((_add_rows, (str(table), "c")), (_read_table, (str(table),)))
    lost += 3 * WRITES - len(read(table)) + unreadable
    cases += 2

    # the digest cache: two writers of the one record file
    files = tmp_path / "files"
    files.mkdir()
    _run((_digests, (str(files), "a")), (_digests, (str(files), "b")))
    memo = json.loads((tmp_path / "cache" / "digests.json").read_text())
    lost += 2 * WRITES - sum(str((files / f"{t}-{i}.bin").resolve()) in memo for t in "ab" for i in range(WRITES))
    cases += 1

    with capsys.disabled():
        print(f"\nconcurrency sweep: {cases} cases, {lost} entries lost, {wrong} results misattributed")
    assert (lost, wrong) == (0, 0)


def test_a_users_card_keeps_its_text_and_its_provenance_is_fixed_at_prune(tiny_checkpoint, tmp_path):
    source = tiny_checkpoint()
    (source / "README.md").write_text("---\nlicense: mit\n---\nA tiny model.\n")
    out = tmp_path / "pruned"
    assert spap("prune", source, "--out", out, *TINY).returncode == 0
    edited = (out / "README.md").read_text().replace("tags:\n", "tags:\n- my-tag\n") + "\n## My notes\n\nkept\n"
    (out / "README.md").write_text(edited)
    (source / "README.md").write_text("---\nlicense: other\n---\n")  # the source's card changes, then goes
    shutil.rmtree(source)
    assert spap("eval", out, *TINY[4:8], "--device", "cpu").returncode == 0
    text = (out / "README.md").read_text()
    front = card.ModelCard(text).data
    assert front.license == "mit" and "my-tag" in front.tags and "spap" in front.tags
    assert text.endswith("## My notes\n\nkept\n") and "## Evaluations" in text
    assert json.loads((out / MANIFEST).read_text())["evaluations"][0]["model"].startswith("sha256:")


def test_an_evaluation_of_a_replaced_checkpoint_is_not_recorded_in_its_successor(tiny_checkpoint, tmp_path,
                                                                              monkeypatch):
    import spap_lib as sl

    source = tiny_checkpoint()
    out, successor = tmp_path / "pruned", tmp_path / "successor"
    assert spap("prune", source, "--out", out, *TINY).returncode == 0
    assert spap("prune", source, "--out", successor, "--sparsity", "0.5", *TINY).returncode == 0
    measure = sl.perplexity

    def replaced_while_measured(*args, **kwargs):  # ``spap prune --overwrite`` installs another model meanwhile
        result = measure(*args, **kwargs)
        with atomic_dir(out, records=True) as tmp:
            for f in successor.iterdir():
                shutil.copy(f, tmp / f.name)
        return result
    monkeypatch.setattr(sl, "perplexity", replaced_while_measured)
    result = spap("eval", out, *TINY[4:8], "--device", "cpu")
    assert result.returncode == 0 and "not recorded" in result.stderr and "was replaced" in result.stderr
    assert "evaluations" not in json.loads((out / MANIFEST).read_text())
    assert "## Evaluations" not in (out / "README.md").read_text()


def test_a_card_at_sparsity_0_says_nothing_was_removed(tiny_checkpoint, tmp_path):
    out = tmp_path / "same"
    assert spap("prune", tiny_checkpoint(), "--out", out, "--sparsity", "0", *TINY).returncode == 0
    text = (out / "README.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith(("| MLP width", "| parameters"))]
    assert "physically smaller" not in text and "nothing removed" in text
    assert len(rows) == 2 and all("→" not in r and "unchanged" in r for r in rows), rows


def _hold_resume(folder: str, started, release) -> None:
    from spap_lib.pipeline.resume import LayerCheckpoint

    checkpoint = LayerCheckpoint(folder, {"run": 1})
    started.set()
    release.wait(60)
    checkpoint.clear()


def test_a_resume_folder_in_use_by_a_running_prune_is_refused_up_front(tiny_checkpoint, tmp_path):
    folder = tmp_path / "resume"
    started, release = FORK.Event(), FORK.Event()
    holder = FORK.Process(target=_hold_resume, args=(str(folder), started, release))
    holder.start()
    try:
        assert started.wait(60)
        result = spap("prune", tiny_checkpoint(), "--out", tmp_path / "o", "--resume-dir", folder, *TINY)
        refused(result, "is in use by another prune")
        assert "Loading" not in result.stderr and not (tmp_path / "o").exists()
    finally:
        release.set()
        holder.join(60)
    assert holder.exitcode == 0
    assert spap("prune", tiny_checkpoint(), "--out", tmp_path / "o", "--resume-dir", folder, *TINY).returncode == 0


@pytest.fixture(autouse=True)
def _no_leftover_processes():
    yield
    for child in multiprocessing.active_children():
        child.terminate()


def test_the_revision_is_dirty_for_code_changes_and_not_for_the_tables_a_run_writes(tmp_path, monkeypatch):
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    for name in ("spap_lib/x.py", "results/ablation.csv", "figures/f.png", "bench/results/b.md"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("0\n")
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "x")
    monkeypatch.setattr(manifest, "REPO", tmp_path)
    clean = manifest.git_revision()
    assert clean and not clean.endswith("+dirty")
    for name in ("results/ablation.csv", "figures/f.png", "bench/results/b.md"):  # what a grid or bench writes
        (tmp_path / name).write_text("1\n")
    assert manifest.git_revision() == clean
    (tmp_path / "spap_lib/x.py").write_text("1\n")  # code that differs from the commit
    assert manifest.git_revision() == clean + "+dirty"
