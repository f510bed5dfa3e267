"""Data: row sources (JSONL, Parquet, TFDS, bundled tasks) and resumable,
per-process sharded batches of prompts, demonstrations and preference pairs.

The bundled tasks' TFDS builders live in `jaxrlhf.data.tasks`, imported on
first use so that importing this package does not pull in TFDS.
"""

from jaxrlhf.data.answers import ANSWER_EXTRACTORS
from jaxrlhf.data.dataset import (
    PreferenceBatch,
    PreferenceDataset,
    PromptBatch,
    PromptDataset,
    SFTBatch,
    SFTDataset,
    left_pad,
)
from jaxrlhf.data.sources import (
    SOURCE_KINDS,
    DataError,
    JsonlSource,
    ListSource,
    ParquetSource,
    RowError,
    RowSource,
    TfdsSource,
    open_source,
)

__all__ = [
    "ANSWER_EXTRACTORS",
    "SOURCE_KINDS",
    "DataError",
    "JsonlSource",
    "ListSource",
    "ParquetSource",
    "PreferenceBatch",
    "PreferenceDataset",
    "PromptBatch",
    "PromptDataset",
    "RowError",
    "RowSource",
    "SFTBatch",
    "SFTDataset",
    "TfdsSource",
    "left_pad",
    "open_source",
]
