"""Row sources: random-access sequences of raw rows from JSONL, Parquet, TFDS
builders and the bundled tasks.

A source only reads; it never validates. A row that cannot even be read (a
broken JSON line) raises `RowError`, which the dataset counts and skips like
any other malformed row. Random access (not iteration) is what makes
deterministic shuffling and resuming at an exact position cheap.

`data.source` is resolved by the first matching kind in `SOURCE_KINDS`:
an explicit prefix (`bundled:`, `jsonl:`, `parquet:`, `tfds:`) wins; otherwise
a bundled task name, then a file (by suffix), a folder holding `<split>.jsonl`
or `<split>.parquet`, and finally any TFDS builder name (`name[/config][:version]`).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import pathlib
from typing import Any, Callable, Protocol, Sequence


class DataError(ValueError):
    """A data set that cannot be used at all (missing file, no valid rows, ...)."""


class RowError(Exception):
    """One malformed row; `reason` is the counter it is recorded under."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class RowSource(Protocol):
    """Random access to raw rows (dicts, or anything else: the dataset checks)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")


class ListSource:
    """Rows already in memory (a list of dicts): for programmatic use and tests."""

    def __init__(self, rows: Sequence[Any]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Any:
        return self.rows[index]

    def __repr__(self) -> str:
        return f"ListSource(rows={len(self)})"


class JsonlSource:
    """One JSON object per line (optionally gzipped); lines are parsed lazily."""

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        if not self.path.is_file():
            raise DataError(f"data file not found: {self.path}")
        opener = gzip.open if self.path.suffix == ".gz" else open
        try:  # bytes: a row that is not valid UTF-8 is skipped and counted, not read with replacement chars
            with opener(self.path, "rb") as f:
                self._lines = [line for line in f if line.strip()]
        except OSError as e:
            raise DataError(f"cannot read {self.path}: {e}") from None

    def __len__(self) -> int:
        return len(self._lines)

    def __getitem__(self, index: int) -> Any:
        try:
            text = self._lines[index].decode("utf-8")
        except UnicodeDecodeError as e:
            raise RowError("invalid_utf8", f"{self.path} line {index + 1}: not valid UTF-8 ({e.reason})") from None
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise RowError("bad_json", f"{self.path} line {index + 1}: {e}") from None

    def __repr__(self) -> str:
        return f"JsonlSource({str(self.path)!r}, rows={len(self)})"


class ParquetSource:
    """A Parquet file read into Arrow columns; rows are materialised on access."""

    def __init__(self, path: str | os.PathLike):
        import pyarrow.parquet as pq

        self.path = pathlib.Path(path)
        if not self.path.is_file():
            raise DataError(f"data file not found: {self.path}")
        try:
            table = pq.read_table(self.path)
        except Exception as e:  # pyarrow raises several unrelated types for bad files
            raise DataError(f"cannot read Parquet file {self.path}: {e}") from None
        self._columns = {name: table.column(name) for name in table.column_names}
        self._len = table.num_rows

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {name: column[index].as_py() for name, column in self._columns.items()}

    def __repr__(self) -> str:
        return f"ParquetSource({str(self.path)!r}, rows={len(self)})"


def _decode_bytes(value: Any) -> Any:
    """TFDS returns Text features as bytes; rows should carry str."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    if isinstance(value, dict):
        return {k: _decode_bytes(v) for k, v in value.items()}
    return value


class TfdsSource:
    """A prepared TFDS split read through `as_data_source` (array_record, no TensorFlow)."""

    def __init__(self, builder: Any, split: str):
        self.name = builder.name
        self.split = split
        if split not in builder.info.splits:
            raise DataError(
                f"TFDS data set {builder.name!r} has no split {split!r}; "
                f"it has {', '.join(sorted(builder.info.splits))}"
            )
        self._source = builder.as_data_source(split)

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> Any:
        return _decode_bytes(self._source[index])

    def __repr__(self) -> str:
        return f"TfdsSource({self.name!r}, split={self.split!r}, rows={len(self)})"


def _open_bundled(spec: str, split: str, data_dir: str | None) -> RowSource:
    from jaxrlhf.data.tasks import TASKS, prepare_task

    if spec not in TASKS:
        raise DataError(TASKS.unknown(spec))
    source = TfdsSource(prepare_task(spec, data_dir), split)
    fields = TASKS[spec].builder.JSON_FIELDS
    return JsonFieldsSource(source, fields) if fields else source


class JsonFieldsSource:
    """A source whose named fields hold JSON text (TFDS stores text only): decoded on read, so a bundled
    demonstration's `messages` is a message list again. An empty field is None (a prompt row without one)."""

    def __init__(self, source: RowSource, fields: Sequence[str]):
        self._source, self.fields = source, tuple(fields)

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> Any:
        row = self._source[index]  # type: ignore[index]
        try:
            return {**row, **{k: json.loads(row[k]) if row.get(k) else None for k in self.fields if k in row}}
        except json.JSONDecodeError as e:
            raise RowError("bad_json", str(e)) from None

    def __repr__(self) -> str:
        return f"JsonFieldsSource({self._source!r}, fields={self.fields})"


def _open_tfds(spec: str, split: str, data_dir: str | None) -> RowSource:
    import tensorflow_datasets as tfds

    import jaxrlhf.data.tasks  # noqa: F401  registers the bundled builders by their TFDS names
    from jaxrlhf.data.tasks import default_data_dir

    directory = data_dir if data_dir is not None else str(default_data_dir())
    try:
        builder = tfds.builder(spec, data_dir=directory)
    except Exception as e:  # DatasetNotFoundError and friends: TFDS lists hundreds of names; offer close ones
        import difflib

        from jaxrlhf.data.tasks import TASKS

        names = list(TASKS) + list(tfds.list_builders(with_community_datasets=False))
        close = difflib.get_close_matches(spec.split("/")[0].split(":")[0], names, n=3)
        hint = f"; did you mean {close}?" if close else ""
        raise DataError(
            f"data.source {spec!r} is no bundled task, no existing .jsonl/.parquet file or folder, and no TFDS "
            f"builder ({e.__class__.__name__}){hint} Bundled tasks: {sorted(TASKS)}"
        ) from None
    if not builder.is_prepared():
        try:
            builder.download_and_prepare(file_format="array_record")
        except Exception as e:  # network errors, missing manual files: report, don't trace
            raise DataError(f"cannot prepare TFDS data set {spec!r} in {directory}: {e}") from None
    if str(builder.info.file_format) != str(tfds.core.FileFormat.ARRAY_RECORD):
        raise DataError(
            f"TFDS data set {spec!r} in {directory} is prepared as {builder.info.file_format}; random access "
            "needs array_record: prepare it again with file_format='array_record' into another data_dir"
        )
    return TfdsSource(builder, split)


def _folder_file(folder: pathlib.Path, split: str) -> pathlib.Path:
    for suffix in JSONL_SUFFIXES + PARQUET_SUFFIXES:
        candidate = folder / f"{split}{suffix}"
        if candidate.is_file():
            return candidate
    raise DataError(f"folder {folder} has no {split}.jsonl, {split}.jsonl.gz or {split}.parquet for split {split!r}")


def _open_file(path: pathlib.Path) -> RowSource:
    if path.name.endswith(PARQUET_SUFFIXES):
        return ParquetSource(path)
    return JsonlSource(path)


def _open_folder(spec: str, split: str, data_dir: str | None) -> RowSource:
    return _open_file(_folder_file(pathlib.Path(spec).expanduser(), split))


def _is_bundled(spec: str) -> bool:
    from jaxrlhf.data.tasks import TASKS

    return spec in TASKS


@dataclasses.dataclass(frozen=True)
class SourceKind:
    """One way of reading `data.source`; `matches` decides for unprefixed specs."""

    name: str
    matches: Callable[[str], bool]
    open: Callable[[str, str, str | None], RowSource]


# Resolution order for unprefixed specs; a `<name>:` prefix selects a kind directly.
SOURCE_KINDS: tuple[SourceKind, ...] = (
    SourceKind("bundled", _is_bundled, _open_bundled),
    SourceKind("jsonl", lambda s: s.endswith(JSONL_SUFFIXES), lambda s, split, d: JsonlSource(pathlib.Path(s).expanduser())),
    SourceKind("parquet", lambda s: s.endswith(PARQUET_SUFFIXES), lambda s, split, d: ParquetSource(pathlib.Path(s).expanduser())),
    SourceKind("folder", lambda s: pathlib.Path(s).expanduser().is_dir(), _open_folder),
    SourceKind("tfds", lambda s: True, _open_tfds),
)


def resolve_source_kind(spec: str) -> tuple[SourceKind, str]:
    """The kind that reads `spec` and the spec with any kind prefix removed."""
    kinds = {kind.name: kind for kind in SOURCE_KINDS}
    prefix, sep, rest = spec.partition(":")
    if sep and prefix in kinds:
        return kinds[prefix], rest
    for kind in SOURCE_KINDS:
        if kind.matches(spec):
            return kind, spec
    raise DataError(f"cannot interpret data.source {spec!r}")  # unreachable: tfds matches all


def open_source(spec: str, split: str = "train", data_dir: str | None = None) -> RowSource:
    """Open `data.source` for one split (files ignore the split; folders pick `<split>.*`)."""
    kind, rest = resolve_source_kind(spec)
    return kind.open(rest, split, data_dir)


def file_path(spec: str) -> pathlib.Path | None:
    """The local file `spec` names by prefix or suffix (None for other kinds); no I/O,
    no TFDS import, so config validation can check existence cheaply."""
    prefix, sep, rest = spec.partition(":")
    if sep and prefix in ("jsonl", "parquet"):
        return pathlib.Path(rest).expanduser()
    if spec.endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES):
        return pathlib.Path(spec).expanduser()
    return None
