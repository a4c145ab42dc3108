"""The results table checks itself: one reader for the grid, the figures and the headline, and a writer
that never rewrites a table it could not read whole."""
import pandas as pd
import pytest

from spap_lib.artifact.figures import headline, load_rows
from spap_lib.artifact.grid import KEY, Variant, check_grid, run_grid
from spap_lib.artifact.table import ABLATION, DIGEST, add_rows, read
from spap_lib.errors import ParameterError, TableError


@pytest.fixture(scope="module")
def table_csv(tmp_path_factory, tiny_tokenizer):
    """A real grid table: dense and magnitude at two sparsities on a tiny llama."""
    import torch
    from test_grid import _grid

    windows = torch.randint(0, 128, (4, 24), generator=torch.Generator().manual_seed(1))
    path = tmp_path_factory.mktemp("table") / "ablation.csv"
    run_grid(_grid("llama", tiny_tokenizer, windows), [Variant.parse("magnitude")], [0.2, 0.4], [16], 2, path)
    return path


def _copy(src, tmp_path, text: str | None = None):
    path = tmp_path / "ablation.csv"
    path.write_text(src.read_text() if text is None else text)
    return path


def _refused(path, match: str):
    before = path.read_bytes()
    with pytest.raises(TableError, match=match) as err:
        read(path, ABLATION)
    assert str(path) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(TableError):  # the writer reads the table whole first: nothing is rewritten
        add_rows(path, [{"model": "m"}], KEY, ABLATION)
    assert path.read_bytes() == before
    return str(err.value)


def test_every_row_is_signed_and_reads_back_as_written(table_csv):
    header = table_csv.read_text().splitlines()[0].split(",")
    assert header[-1] == DIGEST
    table = read(table_csv, ABLATION)
    assert len(table) == 3 and DIGEST not in table and table["ppl"].notna().all()


def test_a_row_cut_inside_its_perplexity_is_refused_naming_the_line(table_csv, tmp_path):
    text = table_csv.read_text()
    last = text.splitlines()[-1]
    ppl = last.split(",")[6]
    cut = text[:text.rindex(ppl) + 3]  # "31.00" of "31.0012..."
    assert "line 4" in _refused(_copy(table_csv, tmp_path, cut), "cut short")
    # the same cut with a line end put back: fewer fields than the header
    _refused(_copy(table_csv, tmp_path, cut + "\n"), "fields where the header has")


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "abc", ""])
def test_a_hand_edited_perplexity_is_refused(table_csv, tmp_path, value):
    lines = table_csv.read_text().splitlines()
    fields = lines[2].split(",")
    fields[6] = value
    unsigned = [line.rsplit(",", 1)[0] for line in [lines[0], *lines[1:2], ",".join(fields), *lines[3:]]]
    # edited in place, the row's checksum gives it away; with the checksums removed, the value itself does
    _refused(_copy(table_csv, tmp_path, "\n".join([*lines[:2], ",".join(fields), *lines[3:]]) + "\n"),
             "row_sha256 does not match")
    _refused(_copy(table_csv, tmp_path, "\n".join(unsigned) + "\n"), "ppl is")


def test_two_tables_joined_an_empty_file_and_missing_columns_are_refused(table_csv, tmp_path):
    text = table_csv.read_text()
    _refused(_copy(table_csv, tmp_path, text + text), "the header again")
    _refused(_copy(table_csv, tmp_path, ""), "is empty")
    frame = pd.read_csv(table_csv).drop(columns=[DIGEST])
    for column in ("ppl", "eval_windows"):
        text = frame.drop(columns=column).to_csv(index=False)
        _refused(_copy(table_csv, tmp_path, text), f"lacks the column.*{column}")


def test_the_same_cell_twice_is_refused(table_csv, tmp_path):
    lines = table_csv.read_text().splitlines()
    assert "the same cell as line 2" in _refused(_copy(table_csv, tmp_path, "\n".join([*lines, lines[1]]) + "\n"),
                                                 "the same cell")


def test_rows_of_different_settings_never_show_as_one_number(table_csv, tmp_path):
    frame = read(table_csv, ABLATION, keep_default_na=False)
    other_seed = frame.assign(seed=1, ppl=frame["ppl"] * 2)
    path = tmp_path / "seeds.csv"
    add_rows(path, pd.concat([frame, other_seed]), KEY, ABLATION)
    wide = headline(path).reset_index()
    assert set(wide["calib"]) == {"4×24", "4×24 seed 1"} and len(wide) == 4  # each seed its own row, none averaged
    # an override equal to today's default is shown under the bare label: beside the bare row, it is one cell twice
    pruned = frame[frame["label"] == "magnitude"].iloc[:1]
    twin = pruned.assign(label="magnitude/sort=bogus", hparams='{"sort": 1}')
    add_rows(path, twin, KEY, ABLATION)
    from spap_lib.artifact import figures

    real = figures.exact_labels
    try:
        figures.exact_labels = lambda t: t.assign(label=[lab.split("/")[0] for lab in t["label"]])
        with pytest.raises(TableError, match="would show as one cell"):
            load_rows(path)
    finally:
        figures.exact_labels = real


def test_rows_without_a_tokenizer_beside_rows_with_one_are_another_protocol(table_csv, tmp_path):
    """A grid partly measured again with another split of the text: the rows that record no tokenizer digest, where
    rows of their model and calibration size record one, are shown apart (``calib`` marked) and never ranked against
    the others; where no row records one, nothing is marked."""
    from spap_lib.artifact.figures import UNRECORDED, best_compositions

    frame = read(table_csv, ABLATION, keep_default_na=False)
    assert frame["tokenizer"].ne("").all()  # the grid records the digest of the ids it measured
    older = frame[frame["label"] == "magnitude"].assign(label="spap", method="spap", hparams="{}", resolved_hparams="",
                                                        tokenizer="", ppl=1.0)
    path = tmp_path / "mixed.csv"
    add_rows(path, pd.concat([frame, older]), KEY, ABLATION)
    rows = load_rows(path)
    assert sorted(set(rows["calib"])) == ["4×24", "4×24" + UNRECORDED]
    assert set(rows.loc[rows["calib"] == "4×24" + UNRECORDED, "label"]) == {"spap"}
    assert set(headline(path).reset_index()["calib"]) == {"4×24", "4×24" + UNRECORDED}
    best = best_compositions(path)
    assert not (best["ppl"] == 1.0).any()  # the unrecorded rows' 1.0 never beats the recorded baseline
    unrecorded = tmp_path / "unrecorded.csv"
    add_rows(unrecorded, pd.concat([frame, older]).assign(tokenizer=""), KEY, ABLATION)
    assert set(load_rows(unrecorded)["calib"]) == {"4×24"}


def test_figures_and_tables_come_from_any_valid_table_whatever_its_size(table_csv, tmp_path):
    """One model, one method: every block of the results pages and Figure 2 render."""
    from spap_lib.artifact.figure2 import figure2
    from spap_lib.artifact.render import render_blocks

    path = _copy(table_csv, tmp_path)
    failed = {}
    from spap_lib.artifact import render

    for name, fn in {"ablation": render.render_ablation, "results": render.render_sweep, "table5": render.render_table5,
                     "paper": render.render_paper, "budget128": render.render_budget128, "parts": render.render_parts,
                     "best": render.render_best}.items():
        try:
            fn(str(path))
        except Exception as err:  # noqa: BLE001 - every block is tried, every failure reported
            failed[name] = f"{type(err).__name__}: {err}"
    assert not failed
    blocks = render_blocks(str(path))
    assert "magnitude" in blocks["ablation"]
    figure2(path, tmp_path / "f.png")
    assert (tmp_path / "f.png").stat().st_size > 0
    only_dense = tmp_path / "ablation_dense.csv"
    add_rows(only_dense, read(table_csv, ABLATION, keep_default_na=False).iloc[:1], KEY, ABLATION)
    assert "dense" in render_blocks(str(only_dense))["ablation"]


def test_a_grid_is_checked_before_any_model_is_loaded(table_csv, tmp_path):
    for sparsities, seqlens, match in (([], [16], "sparsities is"), ([0.2], [], "eval_seqlens is"),
                                       ([1.5], [16], "fraction"), ([0.2], [1], "eval_seqlens entry")):
        with pytest.raises(ParameterError, match=match):
            check_grid(sparsities, seqlens, tmp_path / "t.csv")
    with pytest.raises(TableError, match="is a directory"):
        check_grid([0.2], [16], tmp_path)
    with pytest.raises(ParameterError, match="'pgn'"):
        check_grid([0.2], [16], table_csv, tmp_path / "figure.pgn")
    damaged = _copy(table_csv, tmp_path, table_csv.read_text()[:-20])
    with pytest.raises(TableError, match="cut short"):
        check_grid([0.2], [16], damaged, tmp_path / "figure.png")
    check_grid([0.2], [16], table_csv, tmp_path / "figure.svg")


def test_a_table_written_before_rows_were_signed_is_read_and_signed_when_rewritten(table_csv, tmp_path):
    frame = pd.read_csv(table_csv, keep_default_na=False).drop(columns=[DIGEST])
    path = _copy(table_csv, tmp_path, frame.to_csv(index=False))
    assert len(read(path, ABLATION)) == 3
    add_rows(path, [], KEY, ABLATION)
    assert path.read_text().splitlines()[0].endswith(DIGEST)
    assert path.read_text().replace(",", "").count("\n") == 4
    pd.testing.assert_frame_equal(read(path, ABLATION), read(table_csv, ABLATION))
