"""The plan: peak memory and time from a config alone, offline for the paper's aliases, and refusals."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import spap_lib as sl
from spap_lib.checks import ParameterError
from spap_lib.methods.cost_model import PRICES, Shapes, priced, pricing
from spap_lib.plan import GB, plan

REPO = Path(__file__).resolve().parents[1]

# Published parameter counts (billions) of the shipped configs: the plan counts them exactly.
PUBLISHED = {"llama-3.1-8b": 8.03, "llama-3.1-70b": 70.55, "llama-3.2-1b": 1.236, "qwen2.5-0.5b": 0.494,
             "qwen2.5-7b": 7.62, "qwen2.5-72b": 72.71, "opt-125m": 0.125, "opt-6.7b": 6.66}


@pytest.mark.parametrize("alias", sorted(PUBLISHED))
def test_every_paper_alias_plans_offline(alias, monkeypatch):
    from spap_lib.model import loading as models

    monkeypatch.setattr(models, "read_config", lambda *a: pytest.fail("read a config from outside"))
    p = plan(alias, device="h100", dtype="bfloat16", offload="none")
    assert p.memory_gb["weights"] * GB / 2 / 1e9 == pytest.approx(PUBLISHED[alias], rel=2e-3)
    assert p.peak_device_gb > p.memory_gb["weights"] and p.total_seconds > 0
    assert alias in sl.known_models()


def _cost(method, s: Shapes) -> dict:
    """The work of one layer's prune as the plan prices it."""
    return pricing(method).cost(method, s)


def test_memory_terms_follow_their_formulas():
    f64 = {"precision": "float64"}  # the GPU default is tf32 (4-byte Gram state, like float32)
    base = plan("llama-3.1-8b", device="rtx4090", nsamples=64, seqlen=2048, offload="none", hparams=f64)
    double = plan("llama-3.1-8b", device="rtx4090", nsamples=128, seqlen=2048, offload="none", hparams=f64)
    N, d, n = 64 * 2048, 4096, 14336
    assert base.memory_gb["calibration activations"] == pytest.approx(4 * N * d * 2 / GB, rel=1e-3)
    assert double.memory_gb["calibration activations"] == pytest.approx(2 * base.memory_gb["calibration activations"])
    fp32 = plan("llama-3.1-8b", device="rtx4090", nsamples=64, hparams={"precision": "float32"}, offload="none")
    key = "Gram matrix + factor (2 n², in place) (solves)"  # the largest stage without the update: the solves
    # (chunks of 1,024 tokens: with 8,192 the chunk's activations make the dense pass the largest stage)
    solves64, solves32 = (plan("llama-3.1-8b", method="spap_no_update", device="rtx4090", nsamples=64, offload="none",
                               chunk=1024, hparams=hp) for hp in (f64, {}))
    assert solves64.memory_gb[key] == pytest.approx(2 * (n + 1) ** 2 * 8 / GB, rel=1e-6)
    assert solves32.memory_gb[key] == pytest.approx(solves64.memory_gb[key] / 2)  # auto: tf32 on a GPU, 4 bytes
    rounds = "a round's Gram matrix + factor (update rounds)"  # SPAP's largest stage in float32: the update's rounds
    assert rounds not in solves32.memory_gb  # no update: the solves are the largest stage
    # SPAP in float64: the rounds' 8-byte systems with their token samples (0.5 GB) outweigh the dense solves
    assert rounds in base.memory_gb and key not in base.memory_gb
    no_samples = plan("llama-3.1-8b", device="rtx4090", nsamples=64, offload="none", hparams=f64 | {"sketch_tokens": 0})
    assert no_samples.memory_gb[key] == pytest.approx(solves64.memory_gb[key])  # without them the solves are
    assert fp32.seconds["penalty / refit solves"] < base.seconds["penalty / refit solves"] / 10  # 4090 fp64
    score = plan("llama-3.1-8b", method="wanda_sp", device="rtx4090", nsamples=64, offload="none")
    auto = plan("llama-3.1-8b", device="rtx4090", nsamples=64, offload="none")
    assert auto.memory_gb[rounds] == pytest.approx(fp32.memory_gb[rounds])
    assert plan("llama-3.1-8b", device="cpu-2core", nsamples=64, offload="none").memory_gb[rounds] \
        == pytest.approx(fp32.memory_gb[rounds])  # auto is float32 on a CPU too
    assert rounds not in score.memory_gb and score.total_seconds < base.total_seconds / 10


def test_the_updates_token_samples_are_counted_where_x_and_y_are():
    """SPAP's rounds copy ``sketch_tokens`` rows of X and Y (and, resampled, a ranking sample beside each round's):
    on the device when X and Y are there, in host memory when they stream from it, nowhere when a round sees every
    token (no copy)."""
    kw = dict(device="h100", nsamples=128, seqlen=2048)
    d, row = 4096, 2 * 4096 * 2  # an X row and a Y row, bf16
    key, host_key = "token samples (update rounds)", "update's token samples"
    resident, streamed = plan("llama-3.1-8b", offload="none", **kw), plan("llama-3.1-8b", offload="cpu", **kw)
    assert resident.memory_gb[key] == pytest.approx(2 * 16384 * row / GB)  # the ranking sample and a round's
    assert key not in streamed.memory_gb
    lean = plan("llama-3.1-8b", offload="none", hparams={"rank_tokens": 4096, "sketch_tokens": 8192}, **kw)
    assert lean.memory_gb[key] == pytest.approx((4096 + 8192) * row / GB)
    one = plan("llama-3.1-8b", offload="none", hparams={"sketch_resample": False}, **kw)
    assert one.memory_gb[key] == pytest.approx(16384 * row / GB)
    exact = plan("llama-3.1-8b", offload="none", hparams={"sketch_tokens": 0}, **kw)
    assert key not in exact.memory_gb
    assert "token samples" not in str(plan("llama-3.1-8b", method="fasp", **kw).memory_gb)
    # streamed, the samples are host memory: the same run with one round sample fewer needs that much less there
    host_lean = plan("llama-3.1-8b", offload="cpu", hparams={"sketch_resample": False}, **kw)
    assert streamed.peak_host_gb - host_lean.peak_host_gb == pytest.approx(16384 * row / GB)
    s = Shapes(N=128 * 2048, d=d, n=14336, n_keep=11000, in_proj=2, chunk=2048, solve_bytes=4, weight_bytes=2, vocab=1,
               tied=False, streamed=True)
    assert pricing(sl.get_method("spap")).host_set(sl.get_method("spap"), s)[host_key] == 2 * 16384 * row


def test_the_error_curves_price_a_forward_of_their_own_only_when_they_read_a_sample():
    """Reading every token of the allocation's pass, the curves' Gram pass takes the channel statistics, whose stage
    prices that forward (``SPAP.error_curve``); reading a sample of the tokens, they need a forward of their own."""
    s = Shapes(N=16384, d=576, n=1536, n_keep=1228, in_proj=2, chunk=8192, solve_bytes=4, weight_bytes=4, vocab=1,
               tied=False)
    forward = 2 * s.in_proj * s.d * s.n  # per token
    every, sample = (_cost(sl.get_method("spap", allocation="error", error_tokens=t), s) for t in (s.N, s.N // 2))
    assert every["dense channel statistics"]["fp32"] == sample["dense channel statistics"]["fp32"] == forward * s.N
    assert every["error curves"]["fp32"] == 2 * s.N * s.n * s.n  # the Gram product alone
    assert sample["error curves"]["fp32"] == forward * s.N // 2 + 2 * (s.N // 2) * s.n * s.n


def test_paper_headline_setting_on_one_24gb_card():
    """Recorded, not hoped: LLaMA-3.1-8B at 128 x 2048 does not fit a 24 GB card with everything
    resident (weights alone are 15 GB); with the weights in host memory it does, under the 20 GB target."""
    p = plan("llama-3.1-8b", device="rtx4090", nsamples=128, seqlen=2048, offload="none")
    assert not p.fits and p.device_memory_gb == 24 and p.peak_device_gb > 24
    assert "NO" in p.table() and "of 24 GB" in p.table()
    offloaded = plan("llama-3.1-8b", device="rtx4090", nsamples=128, seqlen=2048, offload="cpu")
    assert offloaded.fits and offloaded.peak_device_gb <= 20
    # 70B and 72B on the same card: one layer at a time, X and Y streamed from host memory, under 22 GB
    for alias in ("llama-3.1-70b", "qwen2.5-72b"):
        big = plan(alias, device="rtx4090", nsamples=128, seqlen=2048)
        assert big.fits and big.offload == "cpu" and big.peak_device_gb <= 22, (alias, big.peak_device_gb)
        assert big.memory_gb["calibration activations"] == 0  # X and Y wait in host memory
    # a card too small for even one layer's work names the least memory and the smallest device that has it
    small = plan("llama-3.1-70b", device="rtx4090", device_memory_gb=16.0, nsamples=128, seqlen=2048)
    need = min(plan("llama-3.1-70b", device="rtx4090", nsamples=128, seqlen=2048, offload=m).peak_device_gb
               for m in ("none", "cpu", "disk"))
    assert not small.fits and small.least_device_gb == pytest.approx(need)
    assert f"it needs at least {need:.1f} GB of device memory: e.g. rtx4090 (24 GB)" in small.table()


def test_disk_offload_keeps_hidden_states_out_of_host_memory():
    """With offload=disk the hidden states between layers wait in spill files: on a GPU machine the host peak grows
    with the calibration size only by the MLP inputs and targets streamed from there (2·N·d·b; cpu offload's by the
    hidden states as well), the disk need by the hidden states. Qwen2.5-1.5B at the paper's 128 x 2048: the host
    holds no decoder layer but the one being pruned."""
    small = plan("qwen2.5-1.5b", device="h100", nsamples=32, seqlen=2048, offload="disk", eval_windows=1)
    paper = plan("qwen2.5-1.5b", device="h100", nsamples=128, seqlen=2048, offload="disk", eval_windows=1)
    hidden = 2 * (128 - 32) * 2048 * 1536 * 2 / GB  # as many numbers as X and Y
    assert paper.peak_host_gb - small.peak_host_gb == pytest.approx(hidden, rel=0.01)
    assert paper.disk_gb - small.disk_gb == pytest.approx(hidden, rel=1e-3)
    cpu_small = plan("qwen2.5-1.5b", device="h100", nsamples=32, seqlen=2048, offload="cpu", eval_windows=1)
    cpu_paper = plan("qwen2.5-1.5b", device="h100", nsamples=128, seqlen=2048, offload="cpu", eval_windows=1)
    assert cpu_paper.peak_host_gb - cpu_small.peak_host_gb == pytest.approx(2 * hidden, rel=0.01)
    layers, layer_gb = 28, 1.31e9 * 2 / 28 / GB  # Qwen2.5-1.5B: 28 decoder layers, 1.31B parameters, bf16
    saved = (layers - 1) * layer_gb + 2 * 128 * 2048 * 1536 * 2 / GB  # the other layers, the hidden states
    assert cpu_paper.peak_host_gb - paper.peak_host_gb == pytest.approx(saved, rel=0.02)
    assert paper.memory_gb["calibration activations"] == 0  # X and Y wait in host memory


def test_plan_refuses_what_it_cannot_model():
    with pytest.raises(ParameterError, match="unknown device 'tpu'.*h100"):
        plan("llama-3.1-8b", device="tpu")
    with pytest.raises(ParameterError, match="unknown offload 'ram': use one of auto, none, cpu, disk"):
        plan("llama-3.1-8b", device="h100", offload="ram")
    with pytest.raises(ParameterError, match="nsamples must be an integer >= 1"):
        plan("llama-3.1-8b", device="h100", nsamples=0)


def test_a_run_that_does_not_fit_is_refused_before_loading(tmp_path, tiny_tokenizer, monkeypatch):
    from conftest import tiny_model

    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "m")
    tiny_tokenizer.save_pretrained(tmp_path / "m")
    monkeypatch.setattr(sl, "load", lambda *a, **k: pytest.fail("loaded weights"))
    ok = sl.check_run(str(tmp_path / "m"), method="spap", sparsity=0.2, nsamples=4, seqlen=16)
    assert ok.memory_time.fits and "plan:" in ok.summary()
    counted = sum(p.numel() for p in model.parameters()) * 4 / GB
    assert ok.memory_time.memory_gb["weights"] == pytest.approx(counted, rel=1e-6)
    from spap_lib import validate as api

    monkeypatch.setattr(api, "local_device", lambda device: ("cpu-2core", 1e-6))
    with pytest.raises(ParameterError, match="does not fit with offload='disk': the plan needs .* fewer calibration"):
        sl.check_run(str(tmp_path / "m"), method="spap", sparsity=0.2, nsamples=4, seqlen=16)


def measure_working_memory() -> dict:
    """Predicted and measured working memory (GB) of a prune of a layer wide enough (n = 4096) for its
    tensors to dominate allocator noise; run in a process of its own (see the test)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from spap_lib.evaluation.data import Calibration
    from spap_lib.model.loading import Loaded
    from spap_lib.model.sources import ModelSource

    config = LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=4096, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    loaded = Loaded(model, None, sl.get_adapter(model), ModelSource("t", "dir", "-"), torch.device("cpu"))
    windows = torch.randint(0, 256, (32, 256), generator=torch.Generator().manual_seed(0))
    hp = {"K": 2, "am_iters": 1, "adam_steps": 1, "batch_tokens": 512}
    p = plan("t", method="spap", hparams=hp, nsamples=32, seqlen=256, eval_seqlen=256, config=config)
    # A first prune warms up the libraries (their one-off initialisation is not the method's memory);
    # it is tiny on purpose, so its underdetermined-fit warning is silenced.
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "underdetermined")
        sl.prune(loaded.copy(), Calibration(windows[:2], torch.arange(2), "v", "s", 1, 0), "spap", 0.2, hparams=hp,
                 progress=False)
    report = sl.prune(loaded, Calibration(windows, torch.arange(32), "v", "s", 1, 0), "spap", 0.2, hparams=hp,
                      progress=False)
    mem = report["memory"]
    return {"predicted": p.prune_working_gb, "peak_reset": mem["peak_reset"],
            "measured": (mem["peak_rss_mb"] - mem["rss_before_mb"]) / 1024}


@pytest.mark.slow
def test_predicted_working_memory_matches_a_measured_prune():
    """The plan's memory for a layer's work (everything but the weights) against the resident-set
    increase of a real prune. glibc's malloc raises its mmap threshold as large blocks are freed and then
    keeps later tensors in its heap, so the peak would count freed pages (or reuse pages held before the
    prune) by chance; a fixed threshold gives every large tensor its own mapping, returned when freed, and
    the resident set then follows the live tensors from one run to the next."""
    import json

    code = "import json, tests.test_plan as t; print(json.dumps(t.measure_working_memory()))"
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    m = json.loads(out.stdout.strip().splitlines()[-1])
    if not m["peak_reset"]:
        pytest.skip("no resettable peak resident set on this OS")
    print(f"working memory: predicted {m['predicted'] * 1024:.0f} MB, measured {m['measured'] * 1024:.0f} MB")
    assert 0.7 < m["measured"] / m["predicted"] < 1.3


def test_the_papers_settings_on_a_cpu_name_the_measured_cpu_setting():
    """02's default (the paper's 128 x 2048, whole test split) on a CPU: the plan's hours are printed
    before any work, with the config that gives the setting measured here."""
    import spap_lib as sl

    job = sl.check_run("smollm2-135m", method="spap", sparsity=0.2, nsamples=128, seqlen=2048, eval_seqlen=2048,
                       eval_windows=None, device="cpu")
    assert job.memory_time.total_seconds > 1800
    assert "On this CPU the plan estimates" in job.summary() and "configs/offline.yaml" in job.summary()
    small = sl.check_run("smollm2-135m", method="spap", sparsity=0.2, nsamples=8, seqlen=256, eval_seqlen=128,
                         eval_windows=4, device="cpu")
    assert "configs/offline.yaml" not in small.summary()


def test_each_method_declares_its_own_cost_and_the_plan_names_none():
    """``Method.cost`` and ``Method.working_set`` are the plan's only source of a method's stages: a new
    method's declared costs reach the plan's time and memory, and plan.py names no registered method."""
    import ast
    import dataclasses
    from pathlib import Path

    from spap_lib.methods import METHODS, Method
    from spap_lib.plan import THROUGHPUT

    constants = {n.value for name in ("plan.py", "pricing.py")
                 for n in ast.walk(ast.parse((Path(sl.__file__).parent / name).read_text()))
                 if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert not constants & set(METHODS), constants & set(METHODS)

    seen = {}

    @dataclasses.dataclass
    class Costed(Method):
        name = "costed_for_test"

    def cost(m, s: Shapes):
        seen["shapes"] = s
        return {"declared stage": {"fp32": 1e12, "solve": 2e12, "steps": 500}}

    METHODS[Costed.name] = Costed
    priced(Costed, cost=cost, working_set=lambda m, s: {"declared buffer": 3 * 2**30})
    try:
        p = plan("llama-3.1-8b", method=Costed.name, device="h100", nsamples=64, seqlen=2048, offload="none")
    finally:
        del METHODS[Costed.name], PRICES[Costed]
    row = THROUGHPUT["h100"]
    rates, achieved = row["flops_per_second"], row["achieved"]
    layers = 32
    # fp32 products run at the TF32 rate where the precision is tf32 (Method's default precision is float64); a
    # method's own stages reach the fraction of each rate fitted to measured layers, and pay for their steps
    assert p.seconds["declared stage"] == pytest.approx(layers * (
        1e12 / (rates["matmul_fp32"] * achieved.get("matmul_fp32", 1)) + 2e12 / (rates["cholesky_fp64"]
                                                                                  * achieved["cholesky_fp64"])
        + 500 * row["step_seconds"]))
    assert p.method_stages == ("declared stage",) and p.layers == layers
    assert p.memory_gb["declared buffer"] == pytest.approx(3.0)
    s = seen["shapes"]
    assert (s.N, s.d, s.n, s.in_proj, s.solve_bytes) == (64 * 2048, 4096, 14336, 2, 8) and s.n_keep < s.n
    # SPAP's own stages: K + 1 penalty solves, the rounds only with am_iters > 0
    spap = sl.get_method("spap")
    stages = _cost(spap, s)
    assert stages["penalty / refit solves"]["solve"] == pytest.approx((spap.K + 1) * ((s.n + 1) ** 3 / 3
                                                                                       + 2 * (s.n + 1) ** 2 * s.d))
    assert "Adam steps" in stages and "Adam steps" not in _cost(sl.get_method("spap_no_update"), s)


def test_a_cpu_without_bf16_units_is_planned_at_its_float32_rate(monkeypatch):
    """Where the bf16 products take the float32 kernels (``bf16.rounded``), the plan prices their work at the CPU row's
    float32 rate: SPAP's Adam steps (bf16 products) cost the row's bf16/float32 ratio more, and its solves the same;
    a GPU row keeps its bf16 rate."""
    from spap_lib.plan import THROUGHPUT

    def seconds(kernels, device="cpu-2core"):
        monkeypatch.setenv("SPAP_BF16_PRODUCTS", kernels)
        return plan("smollm2-135m", method="spap", nsamples=32, seqlen=512, device=device).seconds

    native, rounded = seconds("native"), seconds("rounded")
    rates = THROUGHPUT["cpu-2core"]["flops_per_second"]
    assert rounded["Adam steps"] == pytest.approx(native["Adam steps"] * rates["matmul_bf16"] / rates["matmul_fp32"],
                                                  rel=0.02)  # the steps' few sequential costs aside
    assert rounded["penalty / refit solves"] == native["penalty / refit solves"]
    assert seconds("rounded", "h100")["Adam steps"] == seconds("native", "h100")["Adam steps"]


def test_the_plans_times_hold_against_every_measured_layer():
    """bench/results/measured_layer_times.csv: every measured layer time (GPU and CPU, whole prunes and the method
    alone) is within ±30% of the plan's; a change to a method's declared cost or to throughput.json that breaks
    one fails here."""
    out = subprocess.run([sys.executable, "bench/plan_times.py", "--check"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_offloading_from_a_gpu_costs_onloads_and_copies():
    """The GPU row's pipeline terms: offloaded, a prune pays its onloads and hidden-state copies over pageable host
    memory at the fitted rate, and X/Y streamed from pinned memory; a CPU row pays neither."""
    from spap_lib.plan import PERPLEXITY, THROUGHPUT

    kw = dict(nsamples=128, seqlen=2048, device="h100")
    none, cpu = plan("llama-3.1-8b", offload="none", **kw), plan("llama-3.1-8b", offload="cpu", **kw)
    d, N, L = 4096, 128 * 2048, 32
    hidden = L * 2 * 2 * N * d * 2  # two passes over each layer, its inputs in and its outputs out, bf16
    layers = L * cpu.memory_gb["weights"] / 2 * GB  # each layer onloaded once (the plan holds it and its copy)
    assert cpu.seconds["onloading and hidden states"] == pytest.approx(
        (hidden + layers) / (THROUGHPUT["h100"]["pageable_copy_gb_s"] * GB))
    assert "X and Y streamed to the device" in cpu.seconds and "onloading and hidden states" not in none.seconds
    assert cpu.prune_seconds > none.prune_seconds and cpu.seconds[PERPLEXITY] > none.seconds[PERPLEXITY]
    on_cpu = plan("llama-3.1-8b", offload="cpu", nsamples=8, seqlen=256, device="cpu-2core")
    assert not {"onloading and hidden states", "X and Y streamed to the device"} & set(on_cpu.seconds)


def test_a_composition_label_runs_through_the_run_check_and_the_plan(monkeypatch):
    """``spap/select=...,allocation=...,update=...`` is one method argument for 02, the CLI and the plan: its
    parts are printed, a non-uniform allocation says what loading costs, and each part's work is priced."""
    import spap_lib as sl

    monkeypatch.setenv("SPAP_BF16_PRODUCTS", "native")  # the CPU row's bf16 rate, whatever this CPU has

    job = sl.check_run("smollm2-135m", method="spap/select=act_norm,allocation=error", sparsity=0.2, nsamples=8,
                       seqlen=256, eval_seqlen=128, eval_windows=4, device="cpu")
    assert "parts: select act_norm, allocation error, update alternating" in job.summary()
    assert "loads with spap_lib.load, not stock transformers" in job.summary()
    assert "stock transformers" not in sl.check_run("smollm2-135m", method="fasp", sparsity=0.2, nsamples=8,
                                                    seqlen=256, eval_seqlen=128, eval_windows=4,
                                                    device="cpu").summary()
    stages = {name: plan("smollm2-135m", method=label, nsamples=8, seqlen=256).seconds for name, label in
              (("fasp", "fasp"), ("fasp+gd", "spap/select=wanda,update=gd"), ("penalty, no update", "spap/update=none"),
               ("angular", "spap/allocation=angular"), ("error", "spap/allocation=error"),
               ("global", "fasp/allocation=global"))}
    assert "Adam steps" not in stages["fasp"] and "Adam steps" in stages["fasp+gd"]
    # the widths read the dense pass: the angular distances alone, or every channel's statistics (and the curves)
    assert "dense channel statistics" not in stages["angular"] and "dense channel statistics" not in stages["fasp"]
    assert "dense channel statistics" in stages["global"] and "error curves" not in stages["global"]
    assert {"dense channel statistics", "error curves"} <= set(stages["error"])
    assert "penalty / refit solves" in stages["penalty, no update"] and "Adam steps" not in stages["penalty, no update"]
    # a quarter of the windows for the widths: a quarter of the dense pass's forward and of its statistics
    quarter = plan("smollm2-135m", method="spap/allocation=error,allocation_sample=0.25", nsamples=8,
                   seqlen=256).seconds
    uniform = plan("smollm2-135m", method="spap", nsamples=8, seqlen=256).seconds
    for stage in ("calibration forward passes", "dense channel statistics"):
        extra = stages["error"][stage] - uniform.get(stage, 0.0)
        assert quarter[stage] - uniform.get(stage, 0.0) == pytest.approx(extra / 4, rel=0.05)
    # the angular widths' pass with bf16 products: the same work at the bf16 rate, above nothing and below float32's
    low = plan("smollm2-135m", method="spap/allocation=angular,allocation_precision=bf16", nsamples=8,
               seqlen=256).seconds["calibration forward passes"] - uniform["calibration forward passes"]
    assert 0 < low < 0.5 * (stages["angular"]["calibration forward passes"] - uniform["calibration forward passes"])
    with pytest.raises(ParameterError, match="sets update otherwise"):
        sl.check_run("smollm2-135m", method="spap/update=gd", hparams={"update": "ls"}, sparsity=0.2)
    # a preset carries only the settings its parts read: FASP has no rounds to run, no penalty method to select
    with pytest.raises(ParameterError, match="'fasp' does not carry the settings of the update.*or use spap"):
        sl.check_run("smollm2-135m", method="fasp/update=gd", sparsity=0.2)
    with pytest.raises(ParameterError, match="'fasp' does not carry the settings of the selection 'penalty'"):
        sl.get_method("fasp", select="penalty")
    with pytest.raises(ParameterError, match="K"):
        sl.get_method("fasp", K=5)


def test_a_rounded_prune_is_priced_at_its_rounded_width():
    """``round_to`` moves the kept width to a multiple; the plan prices the model the prune will make, not the
    unrounded one (the checkpoint's size and the update's working set follow the kept width)."""
    d, n, L, decoder = 4096, 14336, 32, 6_979_584_000  # LLaMA-3.1-8B: 3 · d parameters per MLP channel
    exact = plan("llama-3.1-8b", device="h100", offload="none")
    rounded = plan("llama-3.1-8b", device="h100", offload="none", round_to=4096)
    n_remove = round(0.2 * decoder / (L * 3 * d))
    keep_exact, keep_rounded = n - n_remove, round((n - n_remove) / 4096) * 4096
    assert keep_rounded != keep_exact
    gap = (keep_rounded - keep_exact) * L * 3 * d * 2 / GB  # bf16 bytes of the channels rounding keeps or drops
    assert rounded.checkpoint_gb - exact.checkpoint_gb == pytest.approx(gap, rel=1e-9)
    assert plan("llama-3.1-8b", device="h100", offload="none", round_to=1).checkpoint_gb == exact.checkpoint_gb
    with pytest.raises(ParameterError, match="round_to"):
        plan("llama-3.1-8b", device="h100", round_to=0)
