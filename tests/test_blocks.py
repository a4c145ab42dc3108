"""Block sizes of deployment formats: ``round_to`` by name, and the line that says what a kept width costs."""
from __future__ import annotations

import pytest
from conftest import calibration

from spap_lib.checks import ParameterError
from spap_lib.errors import surface
from spap_lib.pipeline.blocks import BLOCKS, auto_round_to, round_to_value, width_note


def test_a_format_name_is_its_block_and_a_number_stays_a_number():
    assert [round_to_value(v) for v in ("q4_k_m", "Q8_0", "iq4_nl", "tensor_core", "64", 64, None, "None")] == \
        [256, 32, 32, 8, 64, 64, None, None]
    with pytest.raises(ParameterError, match="q4_k_m, q5_k_s") as err:
        round_to_value("q4_km")
    assert "q4_km" in str(err.value)
    for bad in (0, "0", -8, True, 0.5):
        with pytest.raises(ParameterError, match=r"round_to .* must be an integer >= 1"):
            round_to_value(bad)


def test_every_k_quant_has_256_blocks_and_every_legacy_format_32():
    assert {n for n, b in BLOCKS.items() if b == 256} >= {"q2_k", "q3_k_m", "q4_k_s", "q4_k_m", "q5_k_m", "q6_k"}
    assert {n for n, b in BLOCKS.items() if b == 32} == {"q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "iq4_nl"}


def test_the_width_note_says_what_falls_back_and_which_round_to_avoids_it():
    with surface("cli"):
        odd = width_note([1126])
        legacy_only = width_note([1152, 1152])
    assert "1126" in odd and "not a multiple of 32" in odd and "f16" in odd
    assert "--round-to q8_0" in odd and "--round-to q4_k_m" in odd
    assert "multiple of 32, not of 256" in legacy_only and "--round-to q4_k_m" in legacy_only
    assert "q8_0" not in legacy_only.split(";")[1]  # 32 already divides it: only the K-quants' block is named
    assert width_note([1280, 4864 - 256 * 3]) is None and width_note([]) is None
    assert "round_to='q4_k_m'" in width_note([896 + 32])  # in the caller's language: Python here


def test_a_notebook_takes_round_to_as_a_number_or_a_name_and_nothing_else():
    from typing import Optional, Union

    from spap_lib.checks import check_notebook_parameters

    for value in (None, 64, "q4_k_m"):
        check_notebook_parameters({"__annotations__": {"round_to": Optional[Union[int, str]]}, "round_to": value},
                                  "02_prune")
    for value in (2.5, True):
        with pytest.raises(ParameterError, match="round_to must be (an integer or a string|a string or an integer) "
                                                       "or None"):
            check_notebook_parameters({"__annotations__": {"round_to": Optional[Union[int, str]]}, "round_to": value},
                                      "02_prune")


def test_auto_rounds_a_real_models_widths_to_32_and_leaves_a_narrow_or_odd_mlp_as_it_is():
    assert [auto_round_to(w) for w in (1536, 4864, 2048, 512, 480, 64, 1000)] == [32, 32, 32, 32, None, None, None]


@pytest.mark.parametrize("args,width", [([], "1120 of 1536 (round_to 32)"), (["--round-to", "none"], "1126 of 1536 ("
                                        "the method's own width)"), (["--round-to", "q4_k_m"], "1024 of 1536 (round_to"
                                                                     " 256)")])
def test_spap_plan_prices_the_width_prune_keeps_by_default_and_says_what_it_costs(capsys, args, width):
    """``--round-to auto`` (the default of ``spap prune`` and ``spap plan``) keeps SmolLM2-135M's 20% at 1120
    (FASP's own width is 1126); the plan says which width it priced and the width's one line on llama.cpp."""
    from spap_lib.cli import main

    assert main(["plan", "smollm2-135m", "--method", "fasp", "--nsamples", "8", "--seqlen", "256", *args]) == 0
    out = capsys.readouterr().out
    assert f"kept MLP width {width}" in out
    assert ("not a multiple of 32" in out) == ("none" in args)  # 1126: every quantized ffn_down in f16
    assert ("--round-to q4_k_m (a multiple of 256) avoids it" in out) == ("q4_k_m" not in args)
    assert main(["plan", "smollm2-135m", "--method", "slicegpt", "--nsamples", "8", "--seqlen", "256"]) == 0
    assert "kept MLP width" not in capsys.readouterr().out  # SliceGPT keeps no MLP channels: auto is its own


def test_the_run_check_resolves_auto_from_the_config_it_reads_and_says_so():
    """``spap prune`` hands ``--round-to`` to ``sl.check_run`` as typed: the check resolves ``auto`` from the config
    it reads anyway, and the summary printed before the prune says where the multiple came from."""
    import spap_lib as sl

    job = sl.check_run("smollm2-135m", method="fasp", sparsity=0.2, round_to="auto", device="cpu")
    assert job.round_to == 32 and job.round_to_auto
    assert "round_to 32 (auto): kept width 1120" in job.summary()
    assert sl.check_run("smollm2-135m", method="fasp", sparsity=0.2, round_to="q8_0", device="cpu").summary() \
        .count("round_to 32: kept width 1120") == 1
    assert sl.check_run("smollm2-135m", method="slicegpt", sparsity=0.2, round_to="auto", device="cpu").round_to \
        is None


def test_the_api_and_02_take_auto_as_the_command_line_does(windows):
    """``sl.prune(round_to="auto")`` (02's ``-p round_to auto``) rounds as ``spap prune`` does: a 512-wide MLP keeps a
    multiple of 32, and a whole-model method its own dimensions."""
    import torch
    from conftest import _configs
    from transformers import AutoModelForCausalLM

    import spap_lib as sl
    from spap_lib.model.loading import Loaded
    from spap_lib.model.sources import ModelSource

    config = _configs()["llama"]
    config.intermediate_size = 512
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    loaded = Loaded(model, None, sl.get_adapter(model), ModelSource("tiny", "dir", "-"), torch.device("cpu"))
    calib = calibration(windows)
    report = sl.prune(loaded, calib, "magnitude", 0.2, round_to="auto", progress=False)
    assert report["sparsity"]["round_to"] == 32 and report["sparsity"]["mlp_width"]["pruned"] % 32 == 0
