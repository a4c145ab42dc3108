"""Result tables (``results/ablation.csv``, ``results/zeroshot.csv``) read and written in one place, so a
damaged, hand-edited or mixed table never reaches a cell, a figure or the headline.

* Every row carries ``row_sha256``, a digest of its own fields (column name and text, empty fields left
  out, so a column added later does not change it): a row cut short, edited by hand or spliced in from
  another file is refused, naming the file and the line. A table written before the column existed is
  read unsigned; its rows get their digests the next time a run rewrites it whole.
* The text is parsed before pandas sees it: an empty file, a last line without its line end (a cut copy),
  a header in the middle (two tables joined) and a row with more or fewer fields than the header are
  refused.
* A table with a ``Schema`` (the grid's: ``ABLATION``) is checked column by column: the required columns,
  types and ranges, finite perplexities, JSON settings, and no two rows of one cell.
* ``add_rows`` reads the table whole under its lock (so a damaged table is refused, never rewritten),
  replaces the rows of the same key, signs the new rows and installs the file atomically; rows already
  there keep their text byte for byte.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from spap_lib.errors import TableError
from spap_lib.files import locked, write_text_atomic

DIGEST = "row_sha256"


@dataclass(frozen=True)
class Column:
    """What a column's text must be: ``kind`` text, int, float, bool or json (an object); ``required``: no
    table may lack it and no row leave it empty; ``ge``/``gt``/``le`` bounds; ``allowed`` extra values."""

    kind: str = "text"
    required: bool = False
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    allowed: tuple = ()


@dataclass(frozen=True)
class Schema:
    columns: dict[str, Column]
    key: tuple[str, ...]  # a cell: two rows with these values are one measurement

    def required(self) -> list[str]:
        return [name for name, col in self.columns.items() if col.required]

    def needing(self, *names: str) -> "Schema":
        """The same checks with only ``names`` required (a figure draws from fewer columns than the grid keys)."""
        from dataclasses import replace

        return Schema({k: replace(c, required=k in names) for k, c in self.columns.items()}, self.key)


_R = dict(required=True)
ABLATION = Schema(columns={
    "model": Column(**_R), "method": Column(**_R), "label": Column(**_R),
    "sparsity": Column("float", ge=0, le=1, **_R), "eval_seqlen": Column("int", ge=2, **_R),
    "eval_windows": Column("int", ge=1, allowed=(-1,), **_R), "ppl": Column("float", gt=0, **_R),
    "nsamples": Column("int", ge=1, **_R), "seqlen": Column("int", ge=2, **_R), "seed": Column("int", ge=0, **_R),
    "hparams": Column("json", **_R), "resolved_hparams": Column("json"), "tokenizer": Column(),
    "achieved_sparsity": Column("float", le=1), "achieved_total": Column("float", le=1),
    "mlp_channel_ratio": Column("float", ge=0, le=1), "uniform_width": Column("bool"), "propagate": Column("bool"),
    "prune_seconds": Column("float", ge=0), "allocation_seconds": Column("float", ge=0),
    "resumed_at_layer": Column("int", ge=0), "peak_rss_mb": Column("float", ge=0),
    "cuda_peak_mb": Column("float", ge=0),
}, key=("model", "label", "sparsity", "eval_seqlen", "eval_windows", "nsamples", "seqlen", "seed", "hparams"))
# What a figure or table needs of the grid's rows (older tables lack the calibration and protocol columns).
SHOWN = ABLATION.needing("model", "label", "sparsity", "eval_seqlen", "ppl")


def digest(header: list[str], fields: list[str]) -> str:
    """The row's checksum: its non-empty fields by column name (order and added empty columns do not count)."""
    pairs = sorted((name, value) for name, value in zip(header, fields) if name != DIGEST and value != "")
    return hashlib.sha256(json.dumps(pairs, ensure_ascii=False).encode()).hexdigest()[:16]


@dataclass
class Text:
    """A table as its text: the header and every row's fields, with the line each row starts on."""

    path: Path
    header: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)

    def refuse(self, i: int | None, why: str) -> TableError:
        where = f"{self.path}" + (f", line {self.lines[i]}" if i is not None else "")
        return TableError(f"{where}: {why}; delete that row to have its cell run again, or restore the file "
                          "(git checkout, a backup)" if i is not None else f"{where}: {why}")


def read_text(path: str | Path) -> Text:
    """The table's text, checked for the damage a copy, a cut or a concatenation leaves; a missing file is empty."""
    path = Path(path)
    table = Text(path)
    if path.is_dir():
        raise TableError(f"{path} is a directory, not a results table: give the path of a .csv file")
    if not path.exists():
        return table
    data = path.read_bytes()
    if not data:
        raise TableError(f"{path} is empty (0 bytes; spap never writes an empty table): delete it to start a "
                         "new table, or restore it (git checkout, a backup)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        raise TableError(f"{path}, line {line}: not UTF-8 text (a damaged byte); restore the file "
                         "(git checkout, a backup)") from None
    if not text.endswith("\n"):
        raise TableError(f"{path}: its last line (line {text.count(chr(10)) + 1}) has no line end, so the file "
                         "was cut short; delete that line to have its cell run again, or restore the file")
    reader = csv.reader(io.StringIO(text, newline=""))
    start = 1
    for fields in reader:
        if not table.header:
            table.header = fields
        else:
            table.rows.append(fields)
            table.lines.append(start)
        start = reader.line_num + 1
    _check_shape(table)
    return table


def _check_shape(table: Text) -> None:
    header = table.header
    if len(set(header)) != len(header) or "" in header:
        raise TableError(f"{table.path}, line 1: the header {','.join(header)[:120]!r} has empty or repeated "
                         "column names; restore the file (git checkout, a backup)")
    for i, fields in enumerate(table.rows):
        if fields == header:
            raise table.refuse(i, "the header again: two tables were joined into one file")
        if len(fields) != len(header):
            raise table.refuse(i, f"{len(fields)} fields where the header has {len(header)} (a row cut short, "
                               "or lines of another table)")
        if DIGEST in header:
            stored = fields[header.index(DIGEST)]
            if stored != digest(header, fields):
                raise table.refuse(i, "the row differs from what was written (its row_sha256 does not match: "
                                   "edited, damaged or cut)" if stored else "the row has no row_sha256")


def _value(col: Column, text: str):
    """``text`` as ``col``'s kind, or a ``str`` saying why it is not one."""
    if col.kind == "text":
        return text
    if col.kind == "json":
        try:
            value = json.loads(text)
        except ValueError:
            return "not JSON"
        return value if isinstance(value, dict) else "not a JSON object"
    if col.kind == "bool":
        return {"True": True, "False": False}.get(text, "not True or False")
    try:
        value = float(text)
    except ValueError:
        return f"not {'an integer' if col.kind == 'int' else 'a number'}"
    if not math.isfinite(value):
        return "not finite"
    if col.kind == "int":  # pandas writes an integer column with empty fields as 17.0
        if value != int(value):
            return "not an integer"
        value = int(value)
    if value in col.allowed:
        return value
    for bound, ok in ((col.ge, lambda b: value >= b), (col.gt, lambda b: value > b), (col.le, lambda b: value <= b)):
        if bound is not None and not ok(bound):
            return "out of range"
    return value


def check_schema(table: Text, schema: Schema) -> None:
    """Required columns, every field of the schema's columns, and one row per cell."""
    missing = [c for c in schema.required() if c not in table.header]
    if table.header and missing:
        raise TableError(f"{table.path} lacks the column(s) {', '.join(missing)}: it is not a table of this kind "
                         f"(its columns: {', '.join(table.header[:12])}); give another path or restore it")
    index = {name: table.header.index(name) for name in schema.columns if name in table.header}
    seen: dict[tuple, int] = {}
    for i, fields in enumerate(table.rows):
        parsed = {}
        for name, j in index.items():
            col, text = schema.columns[name], fields[j]
            value = None if text == "" and not col.required else _value(col, text)
            if isinstance(value, str) and col.kind != "text":
                raise table.refuse(i, f"{name} is {text!r}, {value}")
            if col.required and text == "":
                raise table.refuse(i, f"{name} is empty")
            parsed[name] = value
        key = tuple(json.dumps(parsed.get(k), sort_keys=True) for k in schema.key)
        if key in seen:
            raise table.refuse(i, f"the same cell as line {table.lines[seen[key]]} "
                               f"({', '.join(f'{k} {parsed.get(k)}' for k in schema.key[:4])}, ...)")
        seen[key] = i


def read(path: str | Path, schema: Schema | None = None, *, keep_default_na: bool = True) -> pd.DataFrame:
    """The table at ``path`` checked whole (``read_text``, ``check_schema``), as pandas parses it, without its
    digests; an empty frame when there is no file."""
    table = read_text(path)
    if schema is not None:
        check_schema(table, schema)
    if not table.header:
        return pd.DataFrame()
    frame = pd.read_csv(io.StringIO(_render(table)), keep_default_na=keep_default_na)
    return frame.drop(columns=[DIGEST], errors="ignore")


def _field(value) -> str:
    """How a new row's value is written: as pandas writes it (``repr`` of floats), empty for None and NaN."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return repr(value) if isinstance(value, float) else str(value)


def _render(table: Text) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(table.header)
    writer.writerows(table.rows)
    return out.getvalue()


def _key_of(table: Text, fields: list[str], key: tuple[str, ...], schema: Schema | None) -> tuple:
    """A row's key compared as values (``512`` and ``512.0`` are one cell) where the schema types them."""
    out = []
    for k in key:
        text = fields[table.header.index(k)] if k in table.header else ""
        col = schema.columns.get(k) if schema else None
        out.append(_value(col, text) if col and col.kind in ("int", "float") and text else text)
    return tuple(out)


def add_rows(path: str | Path, rows, key: tuple[str, ...] | list[str], schema: Schema | None = None) -> pd.DataFrame:
    """Put ``rows`` (dicts or a DataFrame) in the table at ``path``: under its lock the table is read and
    checked whole, rows with the same ``key`` values are replaced, the rest kept as written; every row is
    signed and the file replaced atomically. Returns the table as ``read`` gives it."""
    records = rows.to_dict("records") if isinstance(rows, pd.DataFrame) else list(rows)
    path = Path(path)
    with locked(path):
        table = read_text(path)
        if schema is not None:
            check_schema(table, schema)
        columns = [c for c in table.header if c != DIGEST]
        columns += [c for r in records for c in r if c not in columns and c != DIGEST]
        columns = list(dict.fromkeys(columns))
        old = [dict(zip(table.header, f)) for f in table.rows]
        merged = Text(path, [*columns, DIGEST])
        new = [[_field(r.get(c)) for c in columns] for r in records]
        for fields in new:
            fields.append(digest(merged.header, fields))
        replaced = {_key_of(merged, f, tuple(key), schema) for f in new}
        for o in old:
            fields = [o.get(c, "") for c in columns]
            fields.append(digest(merged.header, fields))
            if _key_of(merged, fields, tuple(key), schema) not in replaced:
                merged.rows.append(fields)
        merged.rows += new
        merged.lines = list(range(2, len(merged.rows) + 2))
        if schema is not None:
            check_schema(merged, schema)  # a new row that breaks the schema is refused, not written
        write_text_atomic(path, _render(merged))
    return read(path)
