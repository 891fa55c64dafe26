"""Documents: local parquet, jsonl and arrow files, or a folder of them, read in record batches.

A document source is a ``.parquet``, ``.jsonl`` or ``.arrow`` file, or a folder holding such files
at any depth: a ``datasets`` ``save_to_disk`` folder (its ``state.json`` names the arrow files in
order), a hub-cache or downloaded dataset folder of parquet shards, or any folder of them (sorted
by relative path; hidden folders such as ``.cache`` are skipped). Each row's ``text_column`` is
one document.

Parquet and arrow are read with pyarrow (the optional extra ``nobubble[data]``), never whole:
parquet one row group of one column at a time, arrow memory-mapped. jsonl needs no extra: the
standard ``json`` module reads it line by line (blank lines are skipped).

``scan_documents`` checks every file before any work: it opens it, finds the column and its string
type (listing the columns present otherwise), counts the documents and, for jsonl, decodes every
line as UTF-8 and checks the first record. A later jsonl record that is not an object with a
string in the column, or a null in a parquet or arrow column, is found while reading; the caller
writes its output atomically, so nothing is left behind then either.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nobubble.core.errors import MissingExtra
from nobubble.data.config import DOCUMENT_SUFFIXES

_INSTALL = "pip install 'nobubble[data]'"


@dataclass(frozen=True)
class DocumentFile:
    """One checked file of a document source: its path, format and number of documents."""

    path: Path
    kind: str  # "parquet", "jsonl" or "arrow"
    num_docs: int


def is_document_path(source: str) -> bool:
    """Whether ``source`` names a document file or a folder holding one (no checks beyond that)."""
    path = Path(source).expanduser()
    if path.is_file():
        return path.suffix in DOCUMENT_SUFFIXES
    return path.is_dir() and any(_candidates(path))


def document_files(source: str) -> list[Path]:
    """The document files of ``source`` in reading order; ``ValueError`` when it holds none."""
    path = Path(source).expanduser()
    if path.is_file():
        return [path]
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
        raise ValueError(
            f"{source!r} is a datasets DatasetDict folder with the splits {splits}; point the "
            f"data source at one split, e.g. {str(path / (splits or ['train'])[0])!r}"
        )
    snapshots = sorted((path / "snapshots").glob("*")) if (path / "snapshots").is_dir() else []
    if len(snapshots) > 1:
        raise ValueError(
            f"{source!r} is a hub-cache folder with {len(snapshots)} snapshots, whose files "
            f"would be read twice; point the data source at one: {str(snapshots[-1])!r}"
        )
    state = path / "state.json"
    if state.is_file():
        return _save_to_disk_files(path, state)
    files = sorted(_candidates(path), key=lambda p: p.relative_to(path).as_posix())
    if not files:
        raise ValueError(
            f"data folder {source!r} holds no {', '.join(DOCUMENT_SUFFIXES)} file; "
            "add documents to it or point the data source at a file"
        )
    return files


def _candidates(folder: Path) -> Iterator[Path]:
    for p in folder.rglob("*"):
        hidden = any(part.startswith(".") for part in p.relative_to(folder).parts)
        if p.suffix in DOCUMENT_SUFFIXES and not hidden and p.is_file():
            yield p


def _save_to_disk_files(folder: Path, state: Path) -> list[Path]:
    """The arrow files of a ``save_to_disk`` folder, in the order its ``state.json`` lists."""
    names = [f.get("filename") for f in json.loads(state.read_text()).get("_data_files", [])]
    files = [folder / str(name) for name in names]
    missing = [str(f) for f in files if not f.is_file()]
    if not files or missing:
        raise ValueError(
            f"{str(state)!r} lists the data files {names}, but {missing or 'none'} "
            "cannot be read; save the dataset again (Dataset.save_to_disk)"
        )
    return files


def scan_documents(files: list[Path], column: str) -> list[DocumentFile]:
    """Open and check every file (see the module docstring); at least one document in each."""
    scanned = []
    for path in files:
        kind = path.suffix.removeprefix(".")
        if kind == "jsonl":
            num_docs = _scan_jsonl(path, column)
        else:
            num_docs = _scan_arrow_schema(path, kind, column)
        if num_docs == 0:
            raise ValueError(f"{path} holds no document; remove it from the data source")
        scanned.append(DocumentFile(path, kind, num_docs))
    return scanned


def iter_texts(doc: DocumentFile, column: str, batch_rows: int) -> Iterator[list[str]]:
    """The documents of ``doc`` in file order, in lists of at most ``batch_rows``."""
    if doc.kind == "jsonl":
        yield from _jsonl_texts(doc.path, column, batch_rows)
        return
    start = 0
    for batch in _record_batches(doc.path, doc.kind, column, batch_rows):
        values = batch.column(0)
        if values.null_count:
            row = start + values.to_pylist().index(None)
            raise ValueError(
                f"{doc.path}: row {row} of column {column!r} is null, not a document; "
                "drop the null rows from the data"
            )
        start += len(batch)
        yield values.to_pylist()


# ------------------------------------------------------------------ parquet and arrow (pyarrow)


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError as exc:
        raise MissingExtra(
            f"reading parquet and arrow files needs pyarrow ({exc}); install it: {_INSTALL}"
        ) from exc
    return pyarrow


def _scan_arrow_schema(path: Path, kind: str, column: str) -> int:
    pa = _pyarrow()
    try:
        if kind == "parquet":
            parquet = pa.parquet.ParquetFile(path)
            schema, num_docs = parquet.schema_arrow, parquet.metadata.num_rows
        else:
            schema, batches = _open_arrow(path)
            num_docs = sum(len(b) for b in batches)
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(
            f"{path} is not a readable {kind} file ({exc}); remove it or write it again"
        ) from exc
    if column not in schema.names:
        raise ValueError(
            f"{path} has no column {column!r}; its columns: {schema.names}; "
            "set the text column to the one that holds the documents"
        )
    dtype = schema.field(column).type
    if not (pa.types.is_string(dtype) or pa.types.is_large_string(dtype)):
        strings = [f.name for f in schema if pa.types.is_string(f.type)]
        raise ValueError(
            f"column {column!r} of {path} holds {dtype}, not strings; "
            f"its string columns: {strings}; set the text column to one of them"
        )
    return int(num_docs)


def _open_arrow(path: Path) -> tuple[Any, Iterator[Any]]:
    """Schema and record batches of an Arrow IPC file or stream (``datasets`` writes streams)."""
    pa = _pyarrow()
    source = pa.memory_map(str(path))  # zero-copy: batches are read from the page cache
    try:
        reader = pa.ipc.open_file(source)
        return reader.schema, (reader.get_batch(i) for i in range(reader.num_record_batches))
    except pa.ArrowInvalid:
        source.seek(0)
        stream = pa.ipc.open_stream(source)
        return stream.schema, iter(stream)


def _record_batches(path: Path, kind: str, column: str, batch_rows: int) -> Iterator[Any]:
    """Record batches of the one column ``column``, each at most ``batch_rows`` rows."""
    if kind == "parquet":
        # one row group at a time: ParquetFile.iter_batches (pyarrow 26) held memory that grew
        # with the file's size, reading row group by row group stays flat
        parquet = _pyarrow().parquet.ParquetFile(path)
        for group in range(parquet.num_row_groups):
            table = parquet.read_row_group(group, columns=[column])
            yield from table.to_batches(max_chunksize=batch_rows)
        return
    schema, batches = _open_arrow(path)
    index = schema.get_field_index(column)
    for batch in batches:
        one = batch.select([index])
        for offset in range(0, len(one), batch_rows):
            yield one.slice(offset, batch_rows)


# ------------------------------------------------------------------ jsonl (json module)


def _scan_jsonl(path: Path, column: str) -> int:
    """Non-blank lines of ``path``, after decoding every line and checking the first record."""
    count = 0
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            line = _decode(path, number, raw)
            if line.strip():
                if count == 0:
                    _jsonl_text(path, number, line, column)
                count += 1
    return count


def _jsonl_texts(path: Path, column: str, batch_rows: int) -> Iterator[list[str]]:
    texts: list[str] = []
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            line = _decode(path, number, raw)
            if line.strip():
                texts.append(_jsonl_text(path, number, line, column))
            if len(texts) == batch_rows:
                yield texts
                texts = []
    if texts:
        yield texts


def _decode(path: Path, number: int, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{path}: line {number} is not UTF-8 ({exc}); convert the file to UTF-8 "
            "(e.g. iconv -f latin1 -t utf-8) or leave it out of the data source"
        ) from exc


def _jsonl_text(path: Path, number: int, line: str, column: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: line {number} is not JSON ({exc}); fix or drop it") from exc
    if not isinstance(record, dict) or column not in record:
        keys = sorted(record) if isinstance(record, dict) else type(record).__name__
        raise ValueError(
            f"{path}: line {number} has no field {column!r}; its fields: {keys}; "
            "set the text column to the one that holds the documents"
        )
    text = record[column]
    if not isinstance(text, str):
        raise ValueError(
            f"{path}: line {number}: field {column!r} holds {type(text).__name__} "
            f"{text!r:.40}, not a string; set the text column to a text field"
        )
    return text
