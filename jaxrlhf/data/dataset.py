"""Batches for RLHF: prompts (rollouts), demonstrations (SFT warm-up) and
preference pairs (reward modelling).

All three share one stream over a row source:
- the order is a seeded permutation per epoch, so a position (epoch, index)
  plus the seed fully determines what comes next: checkpoints store
  `state_dict()` and resume exactly;
- every process walks the same global order and builds the same global batch
  (prompts are small next to the models). A training run keeps it whole on
  every process: a call's group may live on other hosts, and the executor
  builds only each process's own device shards from it. Given `process_index`
  and `process_count` a stream keeps its own contiguous slice instead, and the
  slices agree on padding length and position with no communication;
- malformed rows (missing key, wrong type, empty, too long, unreadable) are
  skipped and counted by reason; `metrics()` exposes the counters. Only a
  source where a whole epoch holds no valid row is an error.

Sequences are left-padded (generation appends on the right) to a length bucket:
the longest row of the global batch rounded up to a multiple of `pad_multiple`,
capped at the maximum, which bounds the number of compiled shapes.
"""

from __future__ import annotations

import abc
import collections
import dataclasses
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Sequence

import numpy as np

from jaxrlhf.data.answers import ANSWER_EXTRACTORS
from jaxrlhf.data.sources import DataError, RowError, RowSource, open_source
from jaxrlhf.models.chat_template import ChatTemplate, ChatTemplateError
from jaxrlhf.models.lengths import bucket_length
from jaxrlhf.models.tokenizer import Tokenizer, TokenizerError, prompt_prefix

if TYPE_CHECKING:
    from jaxrlhf.config_schema import Config


def left_pad(seqs: Sequence[Sequence[int]], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-aligned int32 tokens [batch, length] and their bool validity mask."""
    tokens = np.full((len(seqs), length), pad_id, dtype=np.int32)
    mask = np.zeros((len(seqs), length), dtype=bool)
    for row, seq in enumerate(seqs):
        if seq:
            tokens[row, length - len(seq):] = seq
            mask[row, length - len(seq):] = True
    return tokens, mask


def _prompt_prefix(tokenizer: Tokenizer, add_bos: bool | None) -> list[int]:
    """What every sequence starts with: the tokenizer's own BOS convention (add_bos=None, as
    `transformers` encodes a prompt) or BOS forced on / off (`data.add_bos`)."""
    try:
        return prompt_prefix(tokenizer, add_bos)
    except TokenizerError as e:
        raise DataError(f"data.add_bos: {e}") from None


def _text_field(row: Any, key: str, *, numbers_ok: bool = False) -> str:
    """The text under `key`, or a RowError naming what is wrong with it."""
    if not isinstance(row, Mapping):
        raise RowError("not_a_mapping", type(row).__name__)
    value = row.get(key)
    if value is None:
        raise RowError("missing_key", f"no key {key!r} (the row has {', '.join(map(repr, list(row)[:8])) or 'no keys'})")
    if numbers_ok and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str):
        raise RowError("wrong_type", f"{key} is {type(value).__name__}")
    if not value.strip():
        raise RowError("empty", key)
    return value


def _render(template: str, prompt: str) -> str:
    """Insert the prompt into the template (plain replace: templates may contain braces)."""
    return template.replace("{prompt}", prompt)


@dataclasses.dataclass(frozen=True)
class ChatFormat:
    """`data.prompt_format=chat`: prompts and demonstrations rendered through the tokenizer's own
    chat template (see `jaxrlhf.models.chat_template`). A text prompt becomes one user message
    (after `data.prompt_template`, behind an optional system message); a row whose prompt field,
    or whose `messages_key`, holds a list of {role, content} messages is taken as that conversation."""

    template: ChatTemplate
    system_prompt: str | None = None
    messages_key: str = "messages"
    tools: tuple[Any, ...] | None = None  # described by the template (`render(tools=...)`), as an environment does

    @classmethod
    def from_config(cls, config: "Config", tokenizer: Tokenizer,
                    tools: Sequence[Any] | None = None) -> "ChatFormat | None":
        """`data.prompt_format=chat`, or `tools` given (an environment's tools, `sft.tools`): the template."""
        data = config.data
        if data.prompt_format == "raw" and tools is None:
            return None
        template = getattr(tokenizer, "chat_template", None)
        if template is None:
            key, fix = (("data.prompt_format=chat", "data.prompt_format=raw") if tools is None
                        else ("sft.tools", "sft.tools=null"))
            raise DataError(
                f"{key}, but the tokenizer {tokenizer!r} ships no chat template "
                f"(tokenizer_config.json 'chat_template' or chat_template.jinja); use {fix}"
            )
        return cls(template, data.system_prompt, data.messages_key, None if tools is None else tuple(tools))

    def messages(self, row: Mapping[str, Any], key: str, text_template: str) -> list[dict[str, Any]]:
        """The conversation of a prompt row: its message list, or its text as one user turn."""
        value = row.get(key) if isinstance(row, Mapping) else None
        if isinstance(value, list):
            return _checked_messages(value, key)
        user = [{"role": "user", "content": _render(text_template, _text_field(row, key))}]
        return ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else []) + user

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False) -> str:
        try:
            return self.template.render(messages, add_generation_prompt=add_generation_prompt,
                                        tools=None if self.tools is None else list(self.tools))
        except ChatTemplateError as e:  # e.g. a template that insists on alternating roles
            raise RowError("chat_template", str(e)) from None


def _checked_messages(value: list[Any], key: str) -> list[dict[str, Any]]:
    for m in value:
        if not (isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise RowError("bad_messages", f"{key}: every message needs a 'role' and a string 'content'")
    if not value:
        raise RowError("empty", key)
    return [dict(m) for m in value]


def assistant_targets(chat: ChatFormat, tokenizer: Tokenizer,
                      messages: Sequence[Mapping[str, Any]]) -> tuple[list[int], list[bool]]:
    """The conversation's tokens and which of them are SFT targets: the assistant turns.

    An assistant turn's text is what rendering it adds to the conversation before it with the
    generation prompt (its content and the template's end-of-turn marker, which the model must
    learn to emit); the whole conversation is tokenized once and a token is a target when any of
    its characters lies in such a span (transformers' `return_assistant_tokens_mask` rule).
    Templates where a turn does not extend the text before it (they rewrite history, e.g. drop
    earlier reasoning) cannot be masked this way.
    """
    text = chat.render(messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = chat.render(messages[:i], add_generation_prompt=True)
        upto = chat.render(messages[: i + 1])
        if not (upto.startswith(before) and text.startswith(upto)):
            raise RowError("chat_template", f"rendering turn {i} does not extend the conversation before it")
        spans.append((len(before), len(upto)))
    if not spans:
        raise RowError("no_assistant_turn", "a conversation for SFT needs an assistant message")
    ids, offsets = tokenizer.encode_with_offsets(text)
    targets = [any(start < hi and end > lo for lo, hi in spans) for start, end in offsets]
    return ids, targets


class _BatchStream(abc.ABC):
    """Deterministic, resumable, per-process sharded batches over a row source."""

    def __init__(
        self,
        source: RowSource,
        *,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        pad_multiple: int = 16,
        process_index: int | None = None,
        process_count: int | None = None,
    ):
        if process_index is None or process_count is None:
            # Unsliced by default: the executor places the global batch on whichever devices a call's
            # group uses, possibly another host's, and each process builds only its own devices' shards.
            process_index, process_count = 0, 1
        if len(source) == 0:
            raise DataError(f"data source {source!r} has no rows")
        if batch_size < 1 or batch_size % process_count:
            raise DataError(
                f"batch size {batch_size} must be positive and divisible by the number of processes {process_count}"
            )
        if not 0 <= process_index < process_count:
            raise DataError(f"process_index {process_index} is outside [0, {process_count})")
        self.source = source
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.pad_multiple = pad_multiple
        self.process_index = process_index
        self.process_count = process_count
        self.epoch = 0
        self.index = 0
        self.skipped: collections.Counter[str] = collections.Counter()  # distinct rows, by reason
        self._first_skip: dict[str, str] = {}  # reason -> the first row skipped for it, for error messages
        self._order_cache: tuple[int, np.ndarray] | None = None

    # -- subclasses -------------------------------------------------------------
    @abc.abstractmethod
    def _encode(self, row: Any) -> Any:
        """One source row -> an encoded item; raises RowError for a malformed row."""

    @abc.abstractmethod
    def _length(self, item: Any) -> int:
        """Token length of an encoded item (decides the padding bucket)."""

    @abc.abstractmethod
    def _collate(self, row_ids: np.ndarray, items: list[Any], length: int) -> Any:
        """Encoded items -> one padded batch of `length` tokens."""

    @abc.abstractmethod
    def _max_len(self) -> int:
        """Longest item accepted; longer rows are skipped and counted."""

    # -- order and position -----------------------------------------------------
    @property
    def local_batch_size(self) -> int:
        return self.batch_size // self.process_count

    @property
    def batches_per_epoch(self) -> int:
        return max(1, len(self.source) // self.batch_size)

    def _order(self, epoch: int) -> np.ndarray:
        if self._order_cache is None or self._order_cache[0] != epoch:
            n = len(self.source)
            order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def _take(self, count: int) -> tuple[list[int], list[Any]]:
        """The next `count` valid rows of the global order, advancing the position."""
        n = len(self.source)
        row_ids: list[int] = []
        items: list[Any] = []
        invalid_in_a_row = 0
        while len(items) < count:
            if self.index >= n:
                self.epoch, self.index = self.epoch + 1, 0
            row_id = int(self._order(self.epoch)[self.index])
            self.index += 1
            try:
                item = self._encode(self.source[row_id])
            except RowError as e:
                if self.epoch == 0:  # epoch 0 draws every row once: later passes meet the same rows again
                    self.skipped[e.reason] += 1
                    self._first_skip.setdefault(e.reason, f"row {row_id + 1}: {e}")
                invalid_in_a_row += 1
                # any 2n - 1 consecutive draws hold one whole epoch (epochs reshuffle, so a run of n
                # invalid draws can straddle two epochs while valid rows exist)
                if invalid_in_a_row >= 2 * n - 1:
                    raise DataError(
                        f"no valid row in a whole pass over {self.source!r}; skipped {self._skip_summary()}"
                    ) from None
                continue
            invalid_in_a_row = 0
            row_ids.append(row_id)
            items.append(item)
        return row_ids, items

    def _skip_summary(self) -> str:
        """'3 rows: missing_key 2 (first: row 1: missing_key: prompt), empty 1 (...)'."""
        parts = [f"{reason} {n}" + (f" (first: {self._first_skip[reason]})" if reason in self._first_skip else "")
                 for reason, n in sorted(self.skipped.items())]
        return f"{sum(self.skipped.values())} of {len(self.source)} rows: " + ", ".join(parts)

    def next_batch(self) -> Any:
        """This process's shard of the next global batch."""
        row_ids, items = self._take(self.batch_size)
        length = bucket_length(max(self._length(item) for item in items), self.pad_multiple,
                               multiple=self.pad_multiple, cap=self._max_len())
        lo = self.process_index * self.local_batch_size
        hi = lo + self.local_batch_size
        return self._collate(np.asarray(row_ids[lo:hi], dtype=np.int64), items[lo:hi], length)

    def single_pass(self, batch_size: int | None = None) -> Iterator[tuple[Any, np.ndarray]]:
        """One ordered pass over every valid row (evaluation): (this process's batch, real-row weights).

        Batches have `batch_size` rows (default: the stream's); the last is filled up by
        repeating rows with weight 0, so every batch has the same shape. The training
        position is not touched.
        """
        size = batch_size or self.batch_size
        if size % self.process_count:
            raise DataError(f"evaluation batch {size} is not divisible by the number of processes {self.process_count}")
        ids, items = [], []
        for row_id in range(len(self.source)):
            try:
                items.append(self._encode(self.source[row_id]))
                ids.append(row_id)
            except RowError:
                continue
        if not items:
            raise DataError(f"no valid row in {self.source!r} for evaluation")
        per = size // self.process_count
        lo, hi = self.process_index * per, (self.process_index + 1) * per
        for start in range(0, len(items), size):
            chunk_ids, chunk = ids[start:start + size], items[start:start + size]
            weight = np.zeros(size, np.float32)
            weight[: len(chunk)] = 1.0
            while len(chunk) < size:
                chunk_ids, chunk = chunk_ids + chunk_ids[: size - len(chunk)], chunk + chunk[: size - len(chunk)]
            length = bucket_length(max(self._length(item) for item in chunk), self.pad_multiple,
                                   multiple=self.pad_multiple, cap=self._max_len())
            yield self._collate(np.asarray(chunk_ids[lo:hi], np.int64), chunk[lo:hi], length), weight[lo:hi]

    def check(self) -> None:
        """Encode one batch's worth of rows without moving the stream or its counters, so that a
        data error (wrong keys, no valid rows, a pair without a prompt) stops a run before any
        stage has spent time: a DPO data error must not wait for the SFT warm-up to finish."""
        state = self.state_dict()
        try:
            self._take(self.batch_size)
        finally:
            self.load_state_dict(state)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        return self.next_batch()

    # -- checkpointing and metrics ----------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain-Python position for checkpoints: epoch, index and the skip counters."""
        return {
            "epoch": self.epoch,
            "index": self.index,
            "num_rows": len(self.source),
            "seed": self.seed,
            "skipped": dict(self.skipped),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue exactly where `state_dict()` was taken (same source and seed required)."""
        if int(state["num_rows"]) != len(self.source) or int(state["seed"]) != self.seed:
            raise DataError(
                f"cannot resume data position: checkpoint has {state['num_rows']} rows and seed {state['seed']}, "
                f"this data set has {len(self.source)} rows and seed {self.seed}"
            )
        self.epoch = int(state["epoch"])
        self.index = int(state["index"])
        self.skipped = collections.Counter({str(k): int(v) for k, v in state.get("skipped", {}).items()})

    def metrics(self) -> dict[str, float]:
        """Counters for the metrics line: fractional epoch and skipped rows by reason."""
        out = {
            "data/epoch": self.epoch + self.index / len(self.source),
            "data/skipped": float(sum(self.skipped.values())),
        }
        out.update({f"data/skipped/{reason}": float(n) for reason, n in sorted(self.skipped.items())})
        return out


# ---------------------------------------------------------------------------------------------
# Prompts for rollouts


@dataclasses.dataclass(frozen=True)
class _PromptItem:
    ids: list[int]
    prompt: str
    answer: str | None
    meta: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class PromptBatch:
    """One process's shard of a prompt batch, left-padded to a length bucket."""

    input_ids: np.ndarray  # int32 [local_batch, length]
    attention_mask: np.ndarray  # bool [local_batch, length]
    prompt_lens: np.ndarray  # int32 [local_batch]
    prompts: tuple[str, ...]  # rendered prompt text (after the template)
    answers: tuple[str | None, ...]  # reference answers for rule rewards (after extraction)
    meta: tuple[dict[str, Any], ...]  # the row's other fields
    row_ids: np.ndarray  # int64 [local_batch], index of each row in the source
    global_batch_size: int


class PromptDataset(_BatchStream):
    """Tokenized prompts with their reference answers, for generation and rule rewards."""

    def __init__(
        self,
        source: RowSource,
        tokenizer: Tokenizer,
        *,
        batch_size: int,
        max_prompt_len: int,
        prompt_key: str = "prompt",
        answer_key: str | None = "answer",
        answer_extract: str = "none",
        template: str = "{prompt}",
        add_bos: bool | None = None,
        chat: ChatFormat | None = None,
        pad_multiple: int = 16,
        shuffle: bool = True,
        seed: int = 0,
        process_index: int | None = None,
        process_count: int | None = None,
    ):
        super().__init__(
            source, batch_size=batch_size, seed=seed, shuffle=shuffle, pad_multiple=pad_multiple,
            process_index=process_index, process_count=process_count,
        )
        self.chat = chat
        if answer_extract not in ANSWER_EXTRACTORS:
            raise DataError(ANSWER_EXTRACTORS.unknown(answer_extract))
        self.tokenizer = tokenizer
        self.max_prompt_len = max_prompt_len
        self.prompt_key = prompt_key
        self.answer_key = answer_key
        self.extract = ANSWER_EXTRACTORS[answer_extract]
        self.template = template
        self.prefix = _prompt_prefix(tokenizer, add_bos)

    @classmethod
    def from_config(
        cls,
        config: "Config",
        tokenizer: Tokenizer,
        *,
        split: str | None = None,
        batch_size: int | None = None,
        process_index: int | None = None,
        process_count: int | None = None,
    ) -> "PromptDataset":
        """The rollout prompt stream described by `config.data` (seed defaults to run.seed; batch size
        to data.batch_size, larger where the algorithm generates more prompts than it trains on)."""
        data = config.data
        split = split or data.split
        return cls(
            open_source(data.source, split, data.data_dir),
            tokenizer,
            batch_size=batch_size or data.batch_size,
            max_prompt_len=data.max_prompt_len,
            prompt_key=data.prompt_key,
            answer_key=data.answer_key,
            answer_extract=data.answer_extract,
            template=data.prompt_template,
            add_bos=data.add_bos,
            chat=ChatFormat.from_config(config, tokenizer),
            pad_multiple=data.pad_multiple,
            shuffle=data.shuffle,
            seed=config.run.seed if data.seed is None else data.seed,
            process_index=process_index,
            process_count=process_count,
        )

    def _max_len(self) -> int:
        return self.max_prompt_len

    def _length(self, item: _PromptItem) -> int:
        return len(item.ids)

    def _encode(self, row: Any) -> _PromptItem:
        if self.chat is not None:  # the template writes BOS itself, as apply_chat_template
            prompt = self.chat.render(self.chat.messages(row, self.prompt_key, self.template),
                                      add_generation_prompt=True)
            prompt_ids = self.tokenizer.encode(prompt)
        else:
            prompt = _render(self.template, _text_field(row, self.prompt_key))
            prompt_ids = self.prefix + self.tokenizer.encode(prompt)
        answer = None
        if self.answer_key is not None:
            answer = self.extract(_text_field(row, self.answer_key, numbers_ok=True))
            if answer is None:
                raise RowError("bad_answer", self.answer_key)
        ids = prompt_ids
        if len(ids) > self.max_prompt_len:
            raise RowError("too_long", f"{len(ids)} > {self.max_prompt_len} tokens")
        meta = {k: v for k, v in row.items() if k not in (self.prompt_key, self.answer_key)}
        return _PromptItem(ids, prompt, answer, meta)

    def _collate(self, row_ids: np.ndarray, items: list[_PromptItem], length: int) -> PromptBatch:
        tokens, mask = left_pad([item.ids for item in items], length, self.tokenizer.pad_id)
        return PromptBatch(
            input_ids=tokens,
            attention_mask=mask,
            prompt_lens=np.asarray([len(item.ids) for item in items], dtype=np.int32),
            prompts=tuple(item.prompt for item in items),
            answers=tuple(item.answer for item in items),
            meta=tuple(item.meta for item in items),
            row_ids=row_ids,
            global_batch_size=self.batch_size,
        )


# ---------------------------------------------------------------------------------------------
# Demonstrations for an SFT warm-up


@dataclasses.dataclass(frozen=True)
class SFTBatch:
    """Prompt + completion + EOS per sequence; the loss covers completion and EOS only.

    Unpacked: one sequence per row, left-padded. Packed: several sequences per row,
    back to back from the left, right-padded; `segment_ids` numbers them (1, 2, ...;
    0 = padding) so attention stays inside each one, and `positions` restart at 0.
    """

    input_ids: np.ndarray  # int32 [local_batch, length]
    attention_mask: np.ndarray  # bool [local_batch, length]
    loss_mask: np.ndarray  # bool [local_batch, length]; True where the token is a target
    positions: np.ndarray  # int32 [local_batch, length]
    segment_ids: np.ndarray | None  # int32 [local_batch, length] when packed
    row_ids: np.ndarray
    global_batch_size: int


class SFTDataset(_BatchStream):
    """Supervised demonstrations (prompt, completion): the SFT stage and the actor's warm-up.

    With `packing`, each row of a batch holds as many whole sequences as fit in
    `max_len` tokens (first fit in stream order, never split), so short
    demonstrations waste no compute on padding.
    """

    def __init__(
        self,
        source: RowSource,
        tokenizer: Tokenizer,
        *,
        batch_size: int,
        max_len: int,
        prompt_key: str = "prompt",
        completion_key: str = "answer",
        template: str = "{prompt}",
        add_bos: bool | None = None,
        chat: ChatFormat | None = None,
        packing: bool = False,
        pad_multiple: int = 16,
        shuffle: bool = True,
        seed: int = 0,
        process_index: int | None = None,
        process_count: int | None = None,
    ):
        super().__init__(
            source, batch_size=batch_size, seed=seed, shuffle=shuffle, pad_multiple=pad_multiple,
            process_index=process_index, process_count=process_count,
        )
        self.tokenizer = tokenizer
        self.max_len = max_len
        self.prompt_key = prompt_key
        self.completion_key = completion_key
        self.template = template
        self.chat = chat
        self.packing = packing
        self.prefix = _prompt_prefix(tokenizer, add_bos)

    @classmethod
    def from_config(
        cls,
        config: "Config",
        tokenizer: Tokenizer,
        *,
        warmup: bool = False,
        split: str | None = None,
        process_index: int | None = None,
        process_count: int | None = None,
        tools: Sequence[Any] | None = None,
    ) -> "SFTDataset":
        """The SFT stage's stream (`data.*`), or with `warmup` the actor's warm-up stream of an
        RL run (`sft.*`, falling back to `data.*`). `tools` (`sft.tools` resolved): demonstrations
        rendered by the chat template with them described, as an environment renders its episodes."""
        data, sft = config.data, config.sft
        if warmup:
            source, default_split, batch_size = sft.source or data.source, sft.split, sft.batch_size
            completion = sft.completion_key or data.answer_key or "answer"
            packing = sft.packing
        else:
            source, default_split, batch_size = data.source, data.split, data.batch_size
            completion, packing = data.answer_key or "answer", data.packing
        return cls(
            open_source(source, split or default_split, data.data_dir),
            tokenizer,
            batch_size=batch_size,
            max_len=data.max_seq_len or data.max_prompt_len + config.generation.max_new_tokens,
            prompt_key=data.prompt_key,
            completion_key=completion,
            template=data.prompt_template,
            add_bos=data.add_bos,
            chat=ChatFormat.from_config(config, tokenizer, tools),
            packing=packing,
            pad_multiple=data.pad_multiple,
            shuffle=data.shuffle,
            seed=config.run.seed if data.seed is None else data.seed,
            process_index=process_index,
            process_count=process_count,
        )

    def _max_len(self) -> int:
        return self.max_len

    def _length(self, item: tuple[list[int], list[bool]]) -> int:
        return len(item[0])

    def _encode(self, row: Any) -> tuple[list[int], list[bool]]:
        """(tokens, which are targets): the completion (and EOS) of a prompt/completion row; with a
        chat template the assistant turns of a conversation (`messages_key`), or of the prompt as a
        user turn and the completion as the assistant's."""
        if self.chat is not None:
            listed = row.get(self.chat.messages_key) if isinstance(row, Mapping) else None
            if isinstance(listed, list):
                messages = _checked_messages(listed, self.chat.messages_key)
            else:
                completion = _text_field(row, self.completion_key, numbers_ok=True)
                messages = [*self.chat.messages(row, self.prompt_key, self.template),
                            {"role": "assistant", "content": completion}]
            ids, targets = assistant_targets(self.chat, self.tokenizer, messages)
        else:
            prompt = _render(self.template, _text_field(row, self.prompt_key))
            completion = _text_field(row, self.completion_key, numbers_ok=True)
            prompt_ids = self.prefix + self.tokenizer.encode(prompt)
            ids = prompt_ids + self.tokenizer.encode(completion) + [self.tokenizer.eos_id]
            targets = [False] * len(prompt_ids) + [True] * (len(ids) - len(prompt_ids))
        if len(ids) > self.max_len:
            raise RowError("too_long", f"{len(ids)} > {self.max_len} tokens")
        return ids, [False] + targets[1:]  # the first token has nothing before it to be predicted from

    def _collate(self, row_ids: np.ndarray, items: list[tuple[list[int], list[bool]]], length: int) -> SFTBatch:
        tokens, mask = left_pad([ids for ids, _ in items], length, self.tokenizer.pad_id)
        loss_mask = np.zeros_like(mask)
        for row, (ids, targets) in enumerate(items):
            loss_mask[row, length - len(ids):] = targets
        positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
        return SFTBatch(tokens, mask, loss_mask, positions, None, row_ids, self.batch_size)

    def next_batch(self) -> SFTBatch:
        return self._next_packed() if self.packing else super().next_batch()

    def _next_packed(self) -> SFTBatch:
        """`batch_size` rows of `max_len` tokens, filled first fit in stream order."""
        rows: list[list[tuple[list[int], list[bool]]]] = [[] for _ in range(self.batch_size)]
        used = [0] * self.batch_size
        row_ids: list[int] = []
        while True:
            position = (self.epoch, self.index, collections.Counter(self.skipped))
            ids, (item,) = self._take(1)
            fit = next((r for r in range(self.batch_size) if used[r] + len(item[0]) <= self.max_len), None)
            if fit is None:  # put it back for the next batch
                self.epoch, self.index, self.skipped = position
                break
            rows[fit].append(item)
            used[fit] += len(item[0])
            row_ids.append(ids[0])
        length = self.max_len
        pad = self.tokenizer.pad_id
        shape = (self.batch_size, length)
        tokens, loss_mask = np.full(shape, pad, np.int32), np.zeros(shape, bool)
        positions, segments = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
        for r, items in enumerate(rows):
            at = 0
            for k, (ids, targets) in enumerate(items, start=1):
                n = len(ids)
                tokens[r, at:at + n] = ids
                loss_mask[r, at:at + n] = targets
                positions[r, at:at + n] = np.arange(n)
                segments[r, at:at + n] = k
                at += n
        lo = self.process_index * self.local_batch_size
        hi = lo + self.local_batch_size
        sl = slice(lo, hi)
        return SFTBatch(tokens[sl], segments[sl] > 0, loss_mask[sl], positions[sl], segments[sl],
                        np.asarray(row_ids, np.int64), self.batch_size)


# ---------------------------------------------------------------------------------------------
# Preference pairs for reward modelling


@dataclasses.dataclass(frozen=True)
class PreferenceBatch:
    """Chosen and rejected sequences (prompt + response + EOS), left-padded to one length so
    both go through a model in one forward. The loss masks mark the response tokens (the
    prompt, or without a prompt key the two texts' common prefix, is excluded)."""

    chosen_ids: np.ndarray  # int32 [local_batch, length]
    chosen_mask: np.ndarray  # bool [local_batch, length]
    rejected_ids: np.ndarray
    rejected_mask: np.ndarray
    chosen_loss_mask: np.ndarray  # bool [local_batch, length]
    rejected_loss_mask: np.ndarray
    row_ids: np.ndarray
    global_batch_size: int


class PreferenceDataset(_BatchStream):
    """(prompt, chosen, rejected) rows; `prompt_key=None` for data sets such as
    hh-rlhf whose chosen/rejected texts already contain the conversation."""

    def __init__(
        self,
        source: RowSource,
        tokenizer: Tokenizer,
        *,
        batch_size: int,
        max_len: int,
        prompt_key: str | None = "prompt",
        chosen_key: str = "chosen",
        rejected_key: str = "rejected",
        template: str = "{prompt}",
        add_bos: bool | None = None,
        pad_multiple: int = 16,
        shuffle: bool = True,
        seed: int = 0,
        process_index: int | None = None,
        process_count: int | None = None,
    ):
        super().__init__(
            source, batch_size=batch_size, seed=seed, shuffle=shuffle, pad_multiple=pad_multiple,
            process_index=process_index, process_count=process_count,
        )
        self.tokenizer = tokenizer
        self.max_len = max_len
        self.prompt_key = prompt_key
        self.chosen_key = chosen_key
        self.rejected_key = rejected_key
        self.template = template
        self.prefix = _prompt_prefix(tokenizer, add_bos)

    @classmethod
    def from_config(
        cls,
        config: "Config",
        tokenizer: Tokenizer,
        *,
        split: str | None = None,
        process_index: int | None = None,
        process_count: int | None = None,
    ) -> "PreferenceDataset":
        """The pair stream of the reward-model and DPO stages (`data.*`)."""
        data = config.data
        return cls(
            open_source(data.source, split or data.split, data.data_dir),
            tokenizer,
            batch_size=data.batch_size,
            max_len=data.max_seq_len or data.max_prompt_len + config.generation.max_new_tokens,
            prompt_key=data.prompt_key,
            chosen_key=data.chosen_key,
            rejected_key=data.rejected_key,
            template=data.prompt_template,
            add_bos=data.add_bos,
            pad_multiple=data.pad_multiple,
            shuffle=data.shuffle,
            seed=config.run.seed if data.seed is None else data.seed,
            process_index=process_index,
            process_count=process_count,
        )

    def _max_len(self) -> int:
        return self.max_len

    def _length(self, item: tuple[list[int], list[int], int]) -> int:
        return max(len(item[0]), len(item[1]))

    def _encode(self, row: Any) -> tuple[list[int], list[int], int]:
        prompt_ids = list(self.prefix)
        if self.prompt_key is not None:
            prompt_ids += self.tokenizer.encode(_render(self.template, _text_field(row, self.prompt_key)))
        pair = []
        for key in (self.chosen_key, self.rejected_key):
            ids = prompt_ids + self.tokenizer.encode(_text_field(row, key, numbers_ok=True)) + [self.tokenizer.eos_id]
            if len(ids) > self.max_len:
                raise RowError("too_long", f"{key}: {len(ids)} > {self.max_len} tokens")
            pair.append(ids)
        chosen, rejected = pair
        if chosen == rejected:
            raise RowError("identical_pair", f"{self.chosen_key} equals {self.rejected_key}")
        shared = len(prompt_ids)
        if self.prompt_key is None:  # the conversation so far is the common prefix of both texts
            shared = next((i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b),
                          min(len(chosen), len(rejected)) - 1)
            if shared <= len(prompt_ids):
                raise DataError(
                    f"data.prompt_key=null: in {self.source!r} a row's {self.chosen_key!r} and {self.rejected_key!r} "
                    "share no token prefix, so there is no prompt to condition on; set data.prompt_key to the "
                    "column that holds the prompt"
                )
        return chosen, rejected, shared

    def _collate(
        self, row_ids: np.ndarray, items: list[tuple[list[int], list[int], int]], length: int
    ) -> PreferenceBatch:
        pad = self.tokenizer.pad_id
        chosen, chosen_mask = left_pad([c for c, _, _ in items], length, pad)
        rejected, rejected_mask = left_pad([r for _, r, _ in items], length, pad)
        chosen_loss, rejected_loss = np.zeros_like(chosen_mask), np.zeros_like(rejected_mask)
        for row, (c, r, shared) in enumerate(items):
            chosen_loss[row, length - len(c) + shared:] = True
            rejected_loss[row, length - len(r) + shared:] = True
        return PreferenceBatch(chosen, chosen_mask, rejected, rejected_mask, chosen_loss, rejected_loss, row_ids,
                               self.batch_size)
