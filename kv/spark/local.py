"""A small import without Spark: `kv spark import` of one local CSV or Parquet file of key
and value columns, when nobody asked for Spark (no master or Spark setting anywhere, no
expressions, no reader options), is read with Arrow in this process, then checked and
written by the very code the task of a one-partition import through Spark runs
(importer.one_task_import, whole_task).

Why: starting Spark costs 7-10 s on a small machine before the first row is read, and its
first jobs several more; a 26,000-row CSV took ~20 s, of which writing took 2. Here it takes
a few seconds, and the cluster ends up with the same keys and values: the file is read as
Spark's reader reads it with kv's defaults (importer.CSV_DEFAULTS), and wherever Arrow's
reader would read it otherwise — a row with too few or too many fields, a column name given
twice, a column whose text form Spark would make (numbers, dates) — the import goes through
Spark after all (`spark_needed` / `read` say why).
"""

from __future__ import annotations

import os
import re
import time

from .bulk import BATCH_BYTES, CONCURRENCY
from .importer import FORMATS, ImportReport, cluster_for_import, one_task_import, source_format

LOCAL_MAX_BYTES = 64 << 20  # a larger file goes to Spark, which can split the work
_CSV_BLOCK_BYTES = 16 << 20  # Arrow's CSV reader refuses a row longer than its block (1 MiB by default)
_SPARK_MAX_CSV_COLUMNS = 20_480  # Spark's CSV option maxColumns


def spark_needed(source: str, fmt: str | None, *, master_from: str, conf: dict, options: dict, key_expr, value_expr, partitions, ship_package: bool) -> str | None:
    """Why this import must go through Spark, or None: it can run here without it."""
    if master_from != "the default" or conf:
        return "a Spark master or setting was given"
    if key_expr is not None or value_expr is not None:
        return "--key-expr/--value-expr are Spark SQL"
    if options:
        return "--option goes to Spark's reader"
    if partitions is not None or ship_package:
        return "--partitions/--ship-package are for Spark's tasks"
    if FORMATS[source_format(source, fmt)] not in ("csv", "parquet"):
        return "JSON is read by Spark"
    if "://" in source or not os.path.isfile(source):
        return "not one local file"
    if os.path.getsize(source) > LOCAL_MAX_BYTES:
        return f"more than {LOCAL_MAX_BYTES >> 20} MiB"
    return None


def read(source: str, fmt: str | None, key_col: str, value_col: str):
    """The file's (key, value) columns as an Arrow table, as Spark would read them; or a
    str saying why Spark must read it instead. A missing column is BadRequest, as in
    importer.shape."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ..errors import BadRequest

    try:
        table = _read_csv(source) if FORMATS[source_format(source, fmt)] == "csv" else pq.read_table(source)
    except (pa.ArrowException, OSError) as e:
        return f"Arrow's reader: {e}"
    if isinstance(table, str):
        return table
    names = table.column_names
    if len({n.lower() for n in names}) != len(names):
        return "a column name occurs twice (Spark does not tell upper from lower case)"
    for role, col in (("key", key_col), ("value", value_col)):
        if col not in names:  # (by its exact name, as importer.shape looks for it)
            raise BadRequest(f"the data has no column {col!r} (its columns: {', '.join(names)}); choose one with --{role}-col or build one with --{role}-expr")
    key, value = (_decoded(table.column(c)) for c in (key_col, value_col))
    if not (pa.types.is_string(key.type) or pa.types.is_large_string(key.type) or pa.types.is_null(key.type)):
        return f"the key column is {key.type}: Spark gives its text form"
    if not any(f(value.type) for f in (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary, pa.types.is_large_binary, pa.types.is_null)):
        return f"the value column is {value.type}: Spark gives its text form"
    key = key.cast(pa.string())
    value = value.cast(pa.binary() if pa.types.is_binary(value.type) or pa.types.is_large_binary(value.type) else pa.string())
    return pa.table({"key": key, "value": value})


def _decoded(column):
    """A dictionary-encoded column (pandas' categories, in Parquet) as its values' type."""
    import pyarrow as pa

    return column.cast(column.type.value_type) if pa.types.is_dictionary(column.type) else column


def _read_csv(path: str):
    """Every column as text (kv reads CSV without inferring types). Spark's reader (with
    multiLine) finds the file's line separator and writes it as "\\n" inside quoted fields;
    an empty field, quoted or not, is null. A file Spark's reader would read otherwise is
    a str: why."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as csv

    with open(path, "rb") as f:
        data = f.read()  # read once: checked as text here, parsed by Arrow from memory
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError:
        return "the file is not UTF-8 (Spark's reader puts U+FFFD for what is not)"
    if "\x00" in text:
        return "the file holds a NUL character (Spark's reader drops some)"
    sep = _line_separator(text)
    problem = _irregular(text, sep)
    if problem:
        return problem
    parse = csv.ParseOptions(newlines_in_values=True)
    read = csv.ReadOptions(block_size=_CSV_BLOCK_BYTES)
    names = csv.open_csv(pa.BufferReader(data), read_options=read, parse_options=parse).schema.names
    if len(names) > _SPARK_MAX_CSV_COLUMNS:
        return f"more than {_SPARK_MAX_CSV_COLUMNS} columns (Spark's reader refuses the file)"
    convert = csv.ConvertOptions(
        column_types={n: pa.string() for n in names}, strings_can_be_null=True, quoted_strings_can_be_null=True, null_values=[""],
    )
    table = csv.read_csv(pa.BufferReader(data), read_options=read, parse_options=parse, convert_options=convert)
    if sep == "\n":
        return table
    return pa.table({n: pc.replace_substring(table.column(n), sep, "\n") for n in table.column_names})


def _line_separator(text: str) -> str:
    """The first line ending of the file, as univocity's detection (Spark's CSV reader)
    finds it: \\r\\n, \\r or \\n."""
    cr, lf = text.find("\r"), text.find("\n")
    if cr == -1:
        return "\n"
    if lf == -1 or cr < lf:
        return "\r\n" if text[cr + 1 : cr + 2] == "\n" else "\r"
    return "\n"


# A quoted field as RFC 4180 has it: a quote at the start of a field, quotes inside it
# doubled, the closing one followed by a comma, a line end or the end of the file.
# (Possessive: no backtracking over a long field.)
_QUOTED = re.compile(r'(?:(?<=[,\r\n])|\A)"(?:[^"]++|"")*+"(?=,|\r|\n|\Z)')


def _irregular(text: str, sep: str) -> str | None:
    """Why Arrow's CSV reader and Spark's (univocity) would read the file differently, or
    None. They agree on RFC 4180 with one kind of line end; they part on a quote anywhere
    else (a field quoted in part, text after a closing quote, a quote escaped as \\", which
    is what Spark's own CSV writer does), and on line ends other than the file's first one
    outside quotes (univocity keeps them in the value; Arrow ends the row)."""
    rest = _QUOTED.sub("", text)
    if '"' in rest:
        return 'a quote outside RFC 4180 quoting (a field quoted in part, text after a closing quote, or \\" for a quote)'
    if sep == "\r\n":
        rest = rest.replace("\r\n", "")
    if any(end != sep and end in rest for end in ("\r", "\n")):
        return "its lines end in more than one way"
    return None


def import_file(
    table,
    endpoints: str,
    *,
    on_duplicate: str = "refuse",
    max_value_bytes: int,
    batch_rows: int = 0,
    batch_bytes: int = BATCH_BYTES,
    concurrency: int = CONCURRENCY,
    token: str | None = None,
    timeout: float | None = None,
    progress: bool = False,
) -> ImportReport:
    """Check, then write a (key, value) Arrow table read by `read`, here, as the one task
    of an import through Spark does (importer.one_task_import)."""
    t0 = time.monotonic()
    settings = cluster_for_import(endpoints, token, batch_rows, batch_bytes, concurrency, timeout, t0)

    def run(task):
        (row,) = task(iter(table.to_batches()))
        return row.column(0)[0].as_py(), row.column(1)[0].as_py()

    return one_task_import(run, None, settings, max_value_bytes=max_value_bytes, on_duplicate=on_duplicate, t0=t0, progress=progress)
