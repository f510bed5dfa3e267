"""Tokenizers: a built-in byte-level tokenizer and a `tokenizer.json` wrapper.

Both follow one small protocol so data loading, rewards and generation never
care which is in use. `encode` adds no special tokens (callers add BOS/EOS
explicitly, so prompts and completions concatenate predictably); `decode`
drops special tokens (what a rule reward wants to read).

Whether a prompt starts with BOS is the tokenizer's own convention
(`special_prefix`), as in `transformers`: Llama-style `tokenizer.json` files
prepend `<s>` / `<|begin_of_text|>` in their post-processor, Qwen2-style ones
prepend nothing. `prompt_prefix` applies it, or forces BOS on or off.
Several ids may end a sequence (Llama 3.1 lists three); `eos_ids` holds them all.
"""

from __future__ import annotations

import functools
import json
import pathlib
import warnings
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from jaxrlhf.models.chat_template import ChatTemplate, ChatTemplateError, special_token_texts


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded, with the file and the reason."""


@runtime_checkable
class Tokenizer(Protocol):
    """What the rest of jaxrlhf needs from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_id(self) -> int | None: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every id that ends a sequence, `eos_id` first."""
        ...

    @property
    def pad_id(self) -> int: ...

    @property
    def special_prefix(self) -> tuple[int, ...]:
        """The special ids this tokenizer itself puts before a text (its BOS, or nothing)."""
        ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes offset by 3: pad=0, bos=1, eos=2, byte b -> b + 3 (vocab 259).

    Needs no files, so bundled tasks and the tiny presets (vocab 384) work out
    of the box. Its convention is to start every prompt with BOS.
    """

    PAD, BOS, EOS = 0, 1, 2
    OFFSET = 3

    @property
    def vocab_size(self) -> int:
        return 256 + self.OFFSET

    @property
    def bos_id(self) -> int:
        return self.BOS

    @property
    def eos_id(self) -> int:
        return self.EOS

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return (self.EOS,)

    @property
    def pad_id(self) -> int:
        return self.PAD

    @property
    def special_prefix(self) -> tuple[int, ...]:
        return (self.BOS,)

    chat_template = None  # no template ships with the built-in tokenizer

    def encode(self, text: str) -> list[int]:
        return [b + self.OFFSET for b in text.encode("utf-8")]

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """`encode` and each byte's character span (every byte of a character maps to that character)."""
        ids, offsets = [], []
        for i, ch in enumerate(text):
            for b in ch.encode("utf-8"):
                ids.append(b + self.OFFSET)
                offsets.append((i, i + 1))
        return ids, offsets

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes(int(i) - self.OFFSET for i in ids if self.OFFSET <= int(i) < self.vocab_size)
        return data.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def _all_ids(value: Any) -> list[int]:
    """config.json ids may be an int, null or a list (several EOS ids): all of them, in order."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


class HFTokenizer:
    """A Hugging Face `tokenizer.json` loaded through the `tokenizers` package.

    Special token ids come from, in order: `tokenizer_config.json` (token
    strings; with an older checkpoint's `special_tokens_map.json` over them,
    as transformers reads it), `config.json` / `generation_config.json` (ids), then explicit
    arguments. A missing pad token falls back to EOS, as for Llama models.
    `eos_ids` is the EOS token plus every `eos_token_id` those two files list,
    so generation stops where `transformers` would.

    `special_prefix` is what `tokenizer.json`'s post-processor puts before a
    text (what `AutoTokenizer` of transformers 5 does: it ignores
    `tokenizer_config.json`'s `add_bos_token` when `tokenizer.json` exists;
    we warn when the two disagree). Tokens it appends after a text (an
    `add_eos_token` template) are not part of a prompt, which is continued.
    """

    def __init__(
        self,
        path: str | pathlib.Path,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
    ):
        from tokenizers import Tokenizer as _RawTokenizer

        path = pathlib.Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.exists():
            raise TokenizerError(f"tokenizer file not found: {file}")
        try:
            self._tok = _RawTokenizer.from_file(str(file))
        except Exception as e:  # the Rust library raises plain Exceptions with its reason
            raise TokenizerError(f"cannot read tokenizer {file}: {e}") from None
        self._tok.no_padding()  # we pad and cut ourselves, as transformers does per call
        self._tok.no_truncation()
        self.path = file
        folder = file.parent
        ids, listed_eos = self._special_ids_from_files(folder)
        explicit = {"bos": bos_token, "eos": eos_token, "pad": pad_token}
        for role, token in explicit.items():
            if token is not None:
                ids[role] = self._require_id(token, f"{role}_token")
        if ids.get("eos") is None:
            raise TokenizerError(
                f"no EOS token known for {file}: add tokenizer_config.json (eos_token) or "
                "config.json (eos_token_id) beside it, or pass eos_token"
            )
        self._prefix = self._post_processor_prefix()
        self._bos = ids.get("bos")
        if self._bos is None and len(self._prefix) == 1:
            self._bos = self._prefix[0]  # the post-processor names the BOS token
        self._eos = ids["eos"]
        self._eos_ids = tuple(dict.fromkeys([self._eos, *listed_eos]))
        self._pad = ids["pad"] if ids.get("pad") is not None else self._eos
        self._warn_if_add_bos_token_disagrees(folder)

    def _require_id(self, token: str, what: str) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"{what} {token!r} is not in the vocabulary of {self.path}")
        return token_id

    def _special_ids_from_files(self, folder: pathlib.Path) -> tuple[dict[str, int | None], list[int]]:
        """Special ids by role, and every EOS id listed in config.json / generation_config.json."""
        ids: dict[str, int | None] = {"bos": None, "eos": None, "pad": None}
        listed_eos: list[int] = []
        for name in ("config.json", "generation_config.json"):
            data = _read_json(folder / name)
            listed_eos += _all_ids(data.get("eos_token_id"))
            for role in ids:
                found = _all_ids(data.get(f"{role}_token_id"))
                if ids[role] is None and found:
                    ids[role] = found[0]
        try:  # tokenizer_config.json's, or an older checkpoint's special_tokens_map.json's, as transformers reads them
            texts = special_token_texts(folder, _read_json(folder / "tokenizer_config.json"))
        except ChatTemplateError as e:
            raise TokenizerError(str(e)) from None
        for role in ids:
            content = texts.get(f"{role}_token")
            if content is not None and self._tok.token_to_id(content) is not None:
                ids[role] = self._tok.token_to_id(content)  # the tokenizer's own config wins
        return ids, listed_eos

    def _post_processor_prefix(self) -> tuple[int, ...]:
        """The ids `encode(text, add_special_tokens=True)` puts before the text's own ids."""
        for probe in ("hello", "a", "0"):
            plain = self._tok.encode(probe, add_special_tokens=False).ids
            if not plain:
                continue  # the probe is outside this vocabulary: try another
            full = self._tok.encode(probe, add_special_tokens=True).ids
            for start in range(len(full) - len(plain) + 1):
                if full[start:start + len(plain)] == plain:
                    return tuple(full[:start])
        return ()

    def _warn_if_add_bos_token_disagrees(self, folder: pathlib.Path) -> None:
        add_bos_token = _read_json(folder / "tokenizer_config.json").get("add_bos_token")
        adds_bos = self._bos is not None and self._prefix[:1] == (self._bos,)
        if isinstance(add_bos_token, bool) and add_bos_token != adds_bos:
            warnings.warn(
                f"{folder / 'tokenizer_config.json'} sets add_bos_token={str(add_bos_token).lower()}, but the "
                f"post-processor of {self.path} {'adds' if adds_bos else 'does not add'} BOS; following "
                "tokenizer.json as transformers 5 does (set data.add_bos to force BOS on or off)",
                stacklevel=3,
            )

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int | None:
        return self._bos

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self._eos_ids

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def special_prefix(self) -> tuple[int, ...]:
        return self._prefix

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """`encode` and each token's (start, end) character span in `text`."""
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, [tuple(o) for o in enc.offsets]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    @functools.cached_property
    def chat_template(self) -> ChatTemplate | None:
        """The chat template shipped beside tokenizer.json, or None."""
        try:
            return ChatTemplate.from_folder(self.path.parent)
        except ChatTemplateError as e:
            raise TokenizerError(str(e)) from None

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r})"


def prompt_prefix(tokenizer: Tokenizer, add_bos: bool | None = None) -> list[int]:
    """The ids every prompt starts with: the tokenizer's own convention (None), or BOS forced on or off.

    None matches what `transformers` gives for `tokenizer(prompt)`, so a model
    sees prompts as it was trained on them (no BOS for Qwen2, BOS for Llama).
    """
    if add_bos is None:
        return list(tokenizer.special_prefix)
    if not add_bos:
        return []
    if tokenizer.bos_id is None:
        raise TokenizerError(f"add_bos=true, but {tokenizer!r} has no BOS token")
    return [tokenizer.bos_id]


def decode_responses(tokenizer: Tokenizer, tokens: Any, mask: Any) -> list[str]:
    """Response text of every row of a batch (padding and every EOS id dropped): what rule rewards read."""
    eos = set(tokenizer.eos_ids)
    return [tokenizer.decode([int(t) for t, m in zip(row, mrow) if m and t not in eos])
            for row, mrow in zip(tokens, mask)]


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise TokenizerError(f"cannot read {path}: {e}") from None
    return data if isinstance(data, dict) else {}


# Named built-in tokenizers; anything else is a path to tokenizer.json or its folder.
BUILTIN_TOKENIZERS: dict[str, Callable[[], Tokenizer]] = {"byte": ByteTokenizer}


def load_tokenizer(spec: str | pathlib.Path) -> Tokenizer:
    """`"byte"` (built-in) or a path to a `tokenizer.json` file or a folder holding one."""
    if isinstance(spec, str) and spec in BUILTIN_TOKENIZERS:
        return BUILTIN_TOKENIZERS[spec]()
    path = pathlib.Path(spec).expanduser()
    if not path.exists():
        raise TokenizerError(
            f"tokenizer {str(spec)!r} is neither a built-in ({', '.join(BUILTIN_TOKENIZERS)}) "
            "nor an existing tokenizer.json file or folder"
        )
    return HFTokenizer(path)
