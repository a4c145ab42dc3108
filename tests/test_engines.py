"""The llama.cpp route (spap_lib.artifact.llamacpp) and its table (results/llamacpp.csv): what is refused before any
work, the table's schema, and the figure and docs block drawn from the table alone. The measurement itself
(``make engines``) builds llama.cpp and is not run here."""
import json
import sys

import pandas as pd
import pytest

from spap_lib.artifact import engines, llamacpp
from spap_lib.errors import ParameterError, SourceError
from spap_lib.files import REPO


def _table(tmp_path, **change):
    rows = []
    for quant, mb in (("f16", 270.0), ("q4_k_m", 105.0)):
        for label, removed, width, shrink in (("dense", 0.0, 1536, 1.0), ("spap-20", 0.2, 1126, 0.84)):
            rows.append({"model": "m", "label": label, "method": label.split("-")[0], "sparsity": removed,
                         "round_to": 0, "achieved_sparsity": removed, "mlp_width": width, "quant": quant,
                         "file_mb": mb * shrink, "eval_seqlen": 512, "eval_windows": 10, "ppl_llamacpp": 30.0,
                         "ppl_transformers": 30.01, "greedy_agreement": 1.0, "prompt_tps": 900.0,
                         "decode_tps": 100 / shrink, "prompt_ratio": 1 / shrink, "decode_ratio": 1 / shrink,
                         "bytes_bound": 1 / shrink, "threads": 2, "repeats": 5, "repack": False,
                         "engine": "llama-cpp-python", "engine_version": "0.3.36", "cpu": "cpu"})
    table = pd.DataFrame(rows)
    for column, value in change.items():
        table.loc[1, column] = value
    path = tmp_path / "llamacpp.csv"
    table.to_csv(path, index=False)
    return path


def test_the_figure_and_the_docs_block_come_from_the_table_alone(tmp_path):
    path = _table(tmp_path)
    fig = engines.figure(path, tmp_path / "speed.png")
    assert (tmp_path / "speed.png").stat().st_size > 10_000
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    assert list(lines["q4_k_m measured"].get_ydata()) == pytest.approx([1.0, 1 / 0.84])
    assert lines["f16 bytes bound"].get_linestyle() == "--"
    block = engines.render(path)
    [row] = [line.split("|")[1:-1] for line in block.splitlines() if "spap-20" in line and "q4_k_m" in line]
    assert [c.strip() for c in row][:6] == ["m", "spap-20", "1126", "20.0%", "q4_k_m", "88.2"]
    assert "medians of 5 interleaved repeats" in block


@pytest.mark.parametrize("change,message", [
    ({"ppl_llamacpp": float("nan")}, r"row 3: ppl_llamacpp is 'nan', not a positive number"),
    ({"label": "dense"}, r"m dense f16 appears twice"),
])
def test_a_damaged_table_is_refused_in_one_line_naming_the_row(tmp_path, change, message):
    with pytest.raises(SourceError, match=message + ".*make engines"):
        engines.check_table(_table(tmp_path, **change))
    path = _table(tmp_path)
    pd.read_csv(path).drop(columns="decode_tps").to_csv(path, index=False)
    with pytest.raises(SourceError, match="columns decode_tps missing"):
        engines.figure(path, tmp_path / "never.png")
    assert not (tmp_path / "never.png").exists()
    table = pd.read_csv(_table(tmp_path))
    table[table["label"] != "dense"].to_csv(path, index=False)
    with pytest.raises(SourceError, match="m at f16 has no dense row"):
        engines.check_table(path)


def test_the_committed_table_holds_its_schema_and_redraws(tmp_path):
    path = REPO / "results" / "llamacpp.csv"
    table = engines.check_table(path)
    assert set(table["quant"]) == set(llamacpp.QUANTS)
    assert (table["engine_version"] == llamacpp.ENGINE_VERSION).all()
    engines.figure(path, tmp_path / "speed.png")


def test_per_layer_widths_and_a_missing_llama_cpp_are_refused_with_the_fix(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "spap_mlp_widths": [8, 12]}))
    with pytest.raises(ParameterError, match="per-layer MLP widths.*allocation=uniform"):
        llamacpp.to_gguf(tmp_path, tmp_path / "x.gguf")
    with pytest.raises(SourceError, match="not a saved checkpoint"):
        llamacpp.check_convertible(tmp_path / "absent")
    with pytest.raises(SourceError, match="converter is not in .*make setup-engines"):
        llamacpp.converter(tmp_path)
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # an import of it fails, as where it was never built
    with pytest.raises(SourceError, match="llama-cpp-python is not installed: run `make setup-engines`"):
        llamacpp.quantize(tmp_path / "x.gguf", tmp_path / "y.gguf", "q8_0", threads=2)
    with pytest.raises(ParameterError, match="quant 'q5'"):
        llamacpp.quantize(tmp_path / "x.gguf", tmp_path / "y.gguf", "q5", threads=2)


def test_the_engine_pin_is_written_once_for_the_build_and_the_converter():
    pins = dict(line.split("==") for line in (REPO / "requirements-engines.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert pins["llama-cpp-python"] == llamacpp.ENGINE_VERSION


def test_a_table_keeps_one_run_per_model_and_says_each_runs_settings(tmp_path):
    path = _table(tmp_path)
    other = pd.read_csv(path).assign(model="q", repeats=3)
    both = engines.with_model(path, other)
    assert list(both["model"]).count("m") == list(both["model"]).count("q") == 4
    both.to_csv(path, index=False)
    again = engines.with_model(path, other.assign(decode_tps=1.0))  # a rerun of q replaces q's rows only
    assert len(again) == 8 and set(again.loc[again["model"] == "q", "decode_tps"]) == {1.0}
    assert (again.loc[again["model"] == "m", "decode_tps"] > 1).all()
    again.to_csv(path, index=False)
    notes = engines.render(path).splitlines()[-2:]
    assert notes[0].startswith("m: ") and "medians of 5" in notes[0]
    assert notes[1].startswith("q: ") and "medians of 3" in notes[1]
    assert engines.with_model(tmp_path / "absent.csv", other) is other
