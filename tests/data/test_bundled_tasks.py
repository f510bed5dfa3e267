"""Bundled tasks: files are small and reproducible; TFDS builders prepare into a
temporary data dir (array_record, no TensorFlow) and read back."""

import importlib.util
import json
import pathlib

import pytest

from jaxrlhf.data.bundled import bundled_file
from jaxrlhf.data.sources import TfdsSource, open_source
from jaxrlhf.data.tasks import TASKS, prepare_task

REPO = pathlib.Path(__file__).resolve().parents[2]
BUNDLED = REPO / "jaxrlhf" / "data" / "bundled"


def _load_script():
    spec = importlib.util.spec_from_file_location("make_bundled_data", REPO / "scripts" / "make_bundled_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bundled_files_are_small_and_reproducible():
    rendered = _load_script().render()
    on_disk = {p.name: p.read_text(encoding="utf-8") for p in BUNDLED.glob("*.jsonl")}
    assert rendered == on_disk, "bundled files differ from scripts/make_bundled_data.py output: regenerate them"
    assert sum(len(t.encode()) for t in on_disk.values()) < 1_000_000


def test_every_task_split_has_a_file():
    for spec in TASKS.values():
        for split in spec.splits:
            assert bundled_file(f"{spec.builder.FILE_PREFIX}_{split}.jsonl").stat().st_size > 0
    with pytest.raises(FileNotFoundError, match="missing"):
        bundled_file("nothing_here.jsonl")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TASKS))
def test_builder_prepares_and_reads_back(name, tmp_path):
    spec = TASKS[name]
    builder = prepare_task(name, tmp_path)
    assert builder.info.file_format.value == "array_record"
    assert list((tmp_path / spec.tfds_name).glob("*/*.array_record-*"))
    for split in spec.splits:
        source = TfdsSource(builder, split)
        expected = [json.loads(line) for line in bundled_file(f"{spec.builder.FILE_PREFIX}_{split}.jsonl").open()]
        assert len(source) == len(expected)
        rows = [source[i] for i in range(len(source))]
        assert all(isinstance(v, str) for row in rows for v in row.values())  # bytes decoded
        as_set = lambda rs: sorted(tuple(sorted(r.items())) for r in rs)  # noqa: E731  TFDS reorders rows
        assert as_set(rows) == as_set(expected)


def test_arithmetic_answers_are_correct_and_test_split_held_out(tmp_path):
    train = open_source("arithmetic", "train", str(tmp_path))
    test = open_source("bundled:arithmetic", "test", str(tmp_path))  # prefix form; reuses the prepared copy
    for source in (train, test):
        for i in range(len(source)):
            a, b = source[i]["prompt"].rstrip("=").split("+")
            assert int(source[i]["answer"]) == int(a) + int(b)
    assert not {train[i]["prompt"] for i in range(len(train))} & {test[i]["prompt"] for i in range(len(test))}


def test_tfds_by_builder_name(tmp_path):
    source = open_source("tfds:jaxrlhf_reverse", "sft", str(tmp_path))
    row = source[0]
    assert row["answer"] == row["prompt"].rstrip(">")[::-1]
