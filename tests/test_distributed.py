"""A data-parallel prune (``torchrun``, gloo on the CPU) against one process on the same tiny checkpoint.

The ranks sum every statistic and gradient (``numerics.collective``), so the kept channels are the same and the
least-squares weights agree to float32 rounding. SPAP's Adam rounds amplify any change in the order of a sum
(docs/scale.md: Several processes), so its weights are compared through the penalty stage's errors, which match,
and its final errors, which stay close.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import char_tokenizer, tiny_model
from safetensors.torch import load_file

ARGS = ["--nsamples", "4", "--seqlen", "32", "--no-eval", "--device", "cpu"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny llama with a character tokenizer (``conftest.char_tokenizer``)."""
    path = tmp_path_factory.mktemp("dp") / "tiny"
    tiny_model("llama").save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


def _env(**extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1]), **extra}


def _one(checkpoint: Path, out: Path, *args: str) -> None:
    cmd = [sys.executable, "-m", "spap_lib.cli", "prune", str(checkpoint), "--out", str(out), *ARGS, *args]
    subprocess.run(cmd, check=True, env=_env(), capture_output=True, timeout=300)


def _ranks(checkpoint: Path, out: Path, *args: str, k: int = 2) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(k), "--master-port", str(_port()),
           "-m", "spap_lib.cli", "prune", str(checkpoint), "--out", str(out), *ARGS, *args]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=300)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _layers(out: Path) -> list[dict]:
    return json.loads((out / "spap_manifest.json").read_text())["layers"]


# a score method's dense pass (cfsp), and a composition's Gram sums, refit and rounds (spap; fasp is its subset)
@pytest.mark.parametrize("method", ["cfsp", "spap"])
def test_two_ranks_match_one_process(checkpoint, tmp_path, method):
    _one(checkpoint, tmp_path / "one", "--method", method)
    run = _ranks(checkpoint, tmp_path / "two", "--method", method, "--resume-dir", str(tmp_path / "resume"))
    assert run.returncode == 0, run.stderr[-2000:]
    plans = [json.loads((tmp_path / d / "spap_plan.json").read_text())["kept_channels"] for d in ("one", "two")]
    assert plans[0] == plans[1]
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("one", "two"))
    assert a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a)  # the same layout
    manifest = json.loads((tmp_path / "two" / "spap_manifest.json").read_text())
    assert manifest["distributed"] == {"world_size": 2, "backend": "gloo", "window_shares": [[0, 2], [2, 4]]}
    assert not (tmp_path / "resume").exists()  # cleared once the checkpoint was installed
    if method != "spap":
        for k in a:
            assert torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-4 * float(a[k].abs().max())), k
        return
    for i, (one, two) in enumerate(zip(_layers(tmp_path / "one"), _layers(tmp_path / "two"))):
        # layer 0 starts from the same inputs; later layers from the outputs of the rounds' slightly other weights
        assert two["rel_error_penalty"] == pytest.approx(one["rel_error_penalty"], rel=1e-4 if i == 0 else 0.02)
        assert two["rel_error_final"] == pytest.approx(one["rel_error_final"], rel=0.2)
        assert two["rel_error_final"] < two["rel_error_penalty"]  # the rounds still improved every layer


def test_rank_outputs_load_stock_and_a_heal_takes_one_process_steps(checkpoint, tmp_path):
    """The ranks' checkpoint loads with stock transformers; healed after the prune (each rank a share of each batch,
    the gradients summed), its weights are one process's, up to the order of the sums."""
    from transformers import AutoModelForCausalLM

    heal = ["--method", "fasp", "--heal-tokens", "128", "--heal", '{"seqlen": 32, "batch": 2, "precision": "float32"}']
    assert _ranks(checkpoint, tmp_path / "two", *heal).returncode == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "two")
    assert model(torch.tensor([[1, 2, 3]])).logits.isfinite().all()
    manifest = json.loads((tmp_path / "two" / "spap_manifest.json").read_text())
    made_by = manifest["command"]
    assert made_by.startswith("torchrun --nproc-per-node 2 -m spap_lib.cli prune ")  # rerunnable as it was run
    assert made_by in (tmp_path / "two" / "README.md").read_text()
    assert manifest["heal"]["steps"] == 2
    _one(checkpoint, tmp_path / "one", *heal)
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("one", "two"))
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-3, atol=1e-3 * float(a[k].abs().max())), k


def test_ranks_with_different_seeds_are_refused(checkpoint, tmp_path):
    """Two ranks started by hand (as two nodes' launchers would) with different --seed: refused before loading."""
    port = str(_port())
    procs = [subprocess.Popen([sys.executable, "-m", "spap_lib.cli", "prune", str(checkpoint), "--out",
                               str(tmp_path / "out"), *ARGS, "--seed", str(rank)],
                              env=_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert all(p.returncode == 2 for p in procs)
    assert "the ranks disagree on the run's seed (rank 0: 0, rank 1: 1)" in errors[0]
    assert not (tmp_path / "out").exists()


def test_more_ranks_than_windows_are_refused(checkpoint, tmp_path):
    run = _ranks(checkpoint, tmp_path / "out", "--nsamples", "1", "--method", "fasp")
    assert run.returncode != 0
    assert "2 ranks for 1 calibration windows" in run.stderr
    assert not (tmp_path / "out").exists()


def test_whole_model_method_is_refused(checkpoint, tmp_path):
    run = _ranks(checkpoint, tmp_path / "out", "--method", "slicegpt")
    assert run.returncode != 0 and "prunes the whole model at once, in one process" in run.stderr
    assert run.stdout.strip() == ""  # refused by the check, before the summary, the load and the calibration


def _plan_minutes(main, capsys, *args: str) -> float:
    assert main(["plan", "llama-3.1-8b", "--device", "h100", "--world-size", "4", *args]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("  time "))
    return float(line.split()[1])


def test_plan_prices_one_rank_and_the_all_reduce(capsys):
    from spap_lib.cli import main
    from spap_lib.methods import get_method
    from spap_lib.pipeline.distributed import reduced_bytes

    assert main(["plan", "llama-3.1-8b", "--device", "h100", "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("world size 4: one rank's plan, 32 of 128 windows")
    assert "    all-reduce, NVLink " in out  # a step of the plan's time, at the default link of a GPU
    ethernet = _plan_minutes(main, capsys, "--link", "ethernet")
    assert ethernet > _plan_minutes(main, capsys)  # 8B SPAP's Adam gradients: slower over Ethernet
    shapes = {"hidden": 4096, "width": 14336, "kept": 11469, "in_proj": 2, "layers": 32}
    # the dense Gram matrix, then 10 rounds of a kept Gram matrix, Y Zᵀ and 10 Adam steps' gate and up gradients
    rounds = 10 * (11470 ** 2 + 4096 * 11470 + 10 * 2 * 11469 * 4096)
    assert reduced_bytes(get_method("spap"), shapes) == 4 * (14337 ** 2 + rounds)
    assert reduced_bytes(get_method("fasp"), shapes) == 4 * 14337 ** 2
    assert main(["plan", "llama-3.1-8b", "--world-size", "129"]) == 2
    assert "--world-size 129: give 1 to --nsamples (128) ranks" in capsys.readouterr().err


def _rank_pid(launcher: subprocess.Popen, rank: int) -> int | None:
    """The pid of ``torchrun``'s worker of ``rank`` (its environment says RANK), or None before it started."""
    for task in Path(f"/proc/{launcher.pid}/task").iterdir():
        for pid in (task / "children").read_text().split():
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in env:
                return int(pid)
    return None


def _killed_in_layer_1(cmd: list[str], resume: Path) -> tuple[subprocess.Popen, float]:
    """Start the two-rank run and SIGKILL rank 1 as soon as layer 0 is committed; the launcher and the kill time."""
    import signal
    import time

    launcher = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and launcher.poll() is None:
        state = resume / "state.json"
        if state.exists() and json.loads(state.read_text())["next"] >= 1:
            os.kill(_rank_pid(launcher, 1), signal.SIGKILL)
            return launcher, time.monotonic()
        time.sleep(0.02)
    launcher.kill()
    pytest.fail("layer 0 was never committed: " + launcher.communicate()[1][-2000:])


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the rank's process through /proc")
def test_a_killed_rank_fails_the_run_and_the_next_run_resumes(checkpoint, tmp_path):
    """Rank 1 killed in layer 1: the run fails within a bounded time on rank 0 too, nothing is installed, and the
    same command resumes at the committed layer with the kept channels and weights of an uninterrupted run."""
    import time

    args = ("--method", "spap", "--resume-dir", str(tmp_path / "resume"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_port()),
           "-m", "spap_lib.cli", "prune", str(checkpoint), "--out", str(tmp_path / "two"), *ARGS, *args]
    launcher, killed = _killed_in_layer_1(cmd, tmp_path / "resume")
    err = launcher.communicate(timeout=120)[1]
    assert launcher.returncode != 0 and time.monotonic() - killed < 60
    # rank 0's one line: its collective failed first, or torchrun stopped it first (a race either may win)
    assert ("rank 0: another rank of this run stopped" in err
            or "rank 0: stopped by torchrun because another rank failed" in err), err[-2000:]
    assert not (tmp_path / "two").exists()  # nothing installed
    committed = json.loads((tmp_path / "resume" / "state.json").read_text())["next"]
    assert committed >= 1

    run = _ranks(checkpoint, tmp_path / "two", *args)  # the same command again
    assert run.returncode == 0, run.stderr[-2000:]
    assert _ranks(checkpoint, tmp_path / "whole", "--method", "spap").returncode == 0
    manifest = json.loads((tmp_path / "two" / "spap_manifest.json").read_text())
    assert manifest["resumed_at_layer"] == committed
    plans = [json.loads((tmp_path / d / "spap_plan.json").read_text())["kept_channels"] for d in ("two", "whole")]
    assert plans[0] == plans[1]
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("two", "whole"))
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=1e-5, atol=1e-6), k
