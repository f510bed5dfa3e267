"""Bundled tasks: TFDS builders over the JSONL files shipped in `jaxrlhf.data.bundled`.

Going through TFDS (rather than reading the JSONL directly) gives bundled
tasks the same path as any user TFDS data set: prepared once into
`array_record` files, then read with random access (`as_data_source`) and no
TensorFlow. The builders live in this package module because TFDS needs the
builder's module to be importable from a package.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any, Iterator

import tensorflow_datasets as tfds

from jaxrlhf.data.bundled import bundled_file
from jaxrlhf.registry import Registry

DEFAULT_DATA_DIR_ENV = "JAXRLHF_DATA_DIR"


def default_data_dir() -> pathlib.Path:
    """Where bundled tasks are prepared unless `data.data_dir` says otherwise."""
    env = os.environ.get(DEFAULT_DATA_DIR_ENV)
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "jaxrlhf" / "tfds"


class _BundledJsonlBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Reads `<FILE_PREFIX>_<split>.jsonl` for every split in SPLITS; text fields only."""

    FILE_PREFIX: str = ""
    FIELDS: tuple[str, ...] = ()
    JSON_FIELDS: tuple[str, ...] = ()  # text fields holding JSON (a message list), decoded when read (sources.py)
    SPLITS: tuple[str, ...] = ()
    DESCRIPTION: str = ""

    def _info(self) -> tfds.core.DatasetInfo:
        features = tfds.features.FeaturesDict({name: tfds.features.Text() for name in self.FIELDS})
        return self.dataset_info_from_configs(
            description=self.DESCRIPTION,
            features=features,
            homepage="https://github.com/jaxrlhf/jaxrlhf",
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict[str, Any]:
        del dl_manager  # bundled: nothing to download
        return {split: self._generate_examples(f"{self.FILE_PREFIX}_{split}.jsonl") for split in self.SPLITS}

    def _generate_examples(self, file_name: str) -> Iterator[tuple[int, dict[str, str]]]:
        with open(bundled_file(file_name), encoding="utf-8") as f:
            for index, line in enumerate(f):
                row = json.loads(line)
                yield index, {name: row[name] for name in self.FIELDS}


class JaxrlhfArithmetic(_BundledJsonlBuilder):
    """Two-operand addition, "12+7=" -> "19"; exact-match verifiable."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Operands 0..29; train/test/sft splits."}
    FILE_PREFIX = "arithmetic"
    FIELDS = ("prompt", "answer")
    SPLITS = ("train", "test", "sft")
    DESCRIPTION = "Addition of two numbers in 0..29; prompt 'a+b=', answer the sum."


class JaxrlhfReverse(_BundledJsonlBuilder):
    """String reversal, "abc>" -> "cba"; exact-match verifiable."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "2..4 letters from a-f; train/test/sft splits."}
    FILE_PREFIX = "reverse"
    FIELDS = ("prompt", "answer")
    SPLITS = ("train", "test", "sft")
    DESCRIPTION = "Reverse a 2-4 letter string over a-f; prompt 'abc>', answer 'cba'."


class JaxrlhfPreference(_BundledJsonlBuilder):
    """Chosen/rejected pairs over arithmetic prompts, for reward modelling."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Correct sum chosen, a near miss rejected."}
    FILE_PREFIX = "preference"
    FIELDS = ("prompt", "chosen", "rejected")
    SPLITS = ("train", "test")
    DESCRIPTION = "Arithmetic prompts with the correct sum chosen and a wrong one rejected."


class JaxrlhfCoding(_BundledJsonlBuilder):
    """Write-a-function prompts whose answer is the asserts that test it, scored in the sandbox."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "51 small functions (40 train, 11 test), each with asserts and a reference solution."}
    FILE_PREFIX = "coding"
    FIELDS = ("prompt", "answer", "solution")
    SPLITS = ("train", "test")
    DESCRIPTION = ("Write a small Python function; answer: the asserts that test it (rule sandboxed_python); "
                   "solution: a reference program that passes them.")


class JaxrlhfCalculator(_BundledJsonlBuilder):
    """Two-digit products to solve with the `calculator` tool; the demonstrations are conversations."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "1100 train, 100 test prompts; 400 demonstrations, 40 % of them calling the tool."}
    FILE_PREFIX = "calculator"
    FIELDS = ("prompt", "answer", "messages", "direct")
    JSON_FIELDS = ("messages", "direct")
    SPLITS = ("train", "test", "sft")
    DESCRIPTION = ("Products of two two-digit numbers, 'What is 37*86?' -> '3182', for env.name=tools with the "
                   "calculator; sft: demonstration conversations (messages: some call the tool; direct: none do).")


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """What the rest of jaxrlhf needs to know about a bundled task."""

    name: str
    builder: type[_BundledJsonlBuilder]
    kind: str  # "prompt" (prompt + reference answer) or "preference" (chosen/rejected)
    prompt_key: str = "prompt"
    answer_key: str | None = "answer"
    reward_rules: tuple[str, ...] = ()  # rule rewards that verify this task
    description: str = ""

    @property
    def splits(self) -> tuple[str, ...]:
        return self.builder.SPLITS

    @property
    def tfds_name(self) -> str:
        return self.builder.name


TASKS: Registry[TaskSpec] = Registry("bundled task", KeyError, {
    spec.name: spec
    for spec in (
        TaskSpec("arithmetic", JaxrlhfArithmetic, "prompt", reward_rules=("exact_match",),
                 description=JaxrlhfArithmetic.DESCRIPTION),
        TaskSpec("reverse", JaxrlhfReverse, "prompt", reward_rules=("exact_match",),
                 description=JaxrlhfReverse.DESCRIPTION),
        TaskSpec("calculator", JaxrlhfCalculator, "prompt", reward_rules=("exact_match",),
                 description=JaxrlhfCalculator.DESCRIPTION),
        TaskSpec("preference", JaxrlhfPreference, "preference", answer_key=None,
                 description=JaxrlhfPreference.DESCRIPTION),
        TaskSpec("coding", JaxrlhfCoding, "prompt", reward_rules=("sandboxed_python",),
                 description=JaxrlhfCoding.DESCRIPTION),
    )
})


def prepare_task(name: str, data_dir: str | os.PathLike | None = None) -> tfds.core.DatasetBuilder:
    """Prepare a bundled task once (array_record files under data_dir) and return its builder."""
    spec = TASKS.get(name)
    directory = pathlib.Path(data_dir) if data_dir is not None else default_data_dir()
    builder = spec.builder(data_dir=str(directory), file_format="array_record")
    builder.download_and_prepare(file_format="array_record")
    return builder
