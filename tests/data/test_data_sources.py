"""Row sources: JSONL (plain, gzipped, folders of splits), Parquet, resolution of `data.source`."""

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxrlhf.data.answers import ANSWER_EXTRACTORS
from jaxrlhf.data.sources import (
    DataError,
    JsonlSource,
    ParquetSource,
    RowError,
    file_path,
    open_source,
    resolve_source_kind,
)

ROWS = [{"question": "1+1=", "answer": "#### 2"}, {"question": "2+3=", "answer": "#### 5"}]


def _jsonl(path, rows, extra_lines=()):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(extra_lines))
    return path


def test_jsonl_rows_and_bad_lines(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", ROWS, ["\n", "{broken\n"])
    source = open_source(str(path))
    assert isinstance(source, JsonlSource) and len(source) == 3  # blank lines are not rows
    assert source[1] == ROWS[1]
    with pytest.raises(RowError) as e:
        source[2]
    assert e.value.reason == "bad_json"


def test_jsonl_gz_and_split_folder(tmp_path):
    with gzip.open(tmp_path / "train.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in ROWS))
    _jsonl(tmp_path / "test.jsonl", ROWS[:1])
    assert len(open_source(str(tmp_path), "train")) == 2
    assert len(open_source(str(tmp_path), "test")) == 1
    with pytest.raises(DataError, match="has no valid.jsonl"):
        open_source(str(tmp_path), "valid")


def test_parquet(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b", None], "answer": [1, 2, 3]}), path)
    source = open_source(str(path))
    assert isinstance(source, ParquetSource) and len(source) == 3
    assert source[1] == {"prompt": "b", "answer": 2}
    assert source[2]["prompt"] is None
    assert isinstance(open_source(f"parquet:{path}"), ParquetSource)


def test_missing_and_unreadable_files(tmp_path):
    with pytest.raises(DataError, match="data file not found"):
        open_source(str(tmp_path / "missing.jsonl"))
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(DataError, match="cannot read Parquet file"):
        open_source(str(tmp_path / "bad.parquet"))
    with pytest.raises(DataError, match="no (such )?TFDS builder"):  # message reworded in sources.py
        open_source("definitely_not_a_builder_xyz", "train", str(tmp_path))


def test_source_resolution(tmp_path):
    assert resolve_source_kind("arithmetic")[0].name == "bundled"
    assert resolve_source_kind("x/y.jsonl")[0].name == "jsonl"
    assert resolve_source_kind("x/y.parquet")[0].name == "parquet"
    assert resolve_source_kind(str(tmp_path))[0].name == "folder"
    assert resolve_source_kind("gsm8k")[0].name == "tfds"
    assert resolve_source_kind("tfds:arithmetic") == (resolve_source_kind("mnist")[0], "arithmetic")
    assert file_path("jsonl:a/b.txt").name == "b.txt" and file_path("arithmetic") is None


def test_answer_extractors():
    assert ANSWER_EXTRACTORS["gsm8k"]("so 48+24=72\n#### 1,072") == "1072"
    assert ANSWER_EXTRACTORS["gsm8k"]("no marker") is None
    assert ANSWER_EXTRACTORS["last_number"]("it is 3 then -4.5") == "-4.5"
    assert ANSWER_EXTRACTORS["none"]("  19 ") == "19"
    assert ANSWER_EXTRACTORS["none"]("   ") is None
