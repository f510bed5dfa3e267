"""Tokenizers: a built-in byte-level tokenizer and a `tokenizer.json` wrapper.

Both follow one small protocol so data loading, rewards and generation never
care which is in use. `encode` adds no special tokens (callers add BOS/EOS
explicitly, so prompts and completions concatenate predictably); `decode`
drops special tokens (what a rule reward wants to read).
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Callable, Protocol, Sequence, runtime_checkable


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
    def pad_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes offset by 3: pad=0, bos=1, eos=2, byte b -> b + 3 (vocab 259).

    Needs no files, so bundled tasks and the tiny presets (vocab 384) work out
    of the box.
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
    def pad_id(self) -> int:
        return self.PAD

    def encode(self, text: str) -> list[int]:
        return [b + self.OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes(int(i) - self.OFFSET for i in ids if self.OFFSET <= int(i) < self.vocab_size)
        return data.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _first_id(value: Any) -> int | None:
    """config.json ids may be an int or a list (several EOS ids); take the first."""
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class HFTokenizer:
    """A Hugging Face `tokenizer.json` loaded through the `tokenizers` package.

    Special token ids come from, in order: `tokenizer_config.json` (token
    strings), `config.json` / `generation_config.json` (ids), then explicit
    arguments. A missing pad token falls back to EOS, as for Llama models.
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
        self.path = file
        folder = file.parent
        ids = self._special_ids_from_files(folder)
        explicit = {"bos": bos_token, "eos": eos_token, "pad": pad_token}
        for role, token in explicit.items():
            if token is not None:
                ids[role] = self._require_id(token, f"{role}_token")
        if ids.get("eos") is None:
            raise TokenizerError(
                f"no EOS token known for {file}: add tokenizer_config.json (eos_token) or "
                "config.json (eos_token_id) beside it, or pass eos_token"
            )
        self._bos = ids.get("bos")
        self._eos = ids["eos"]
        self._pad = ids["pad"] if ids.get("pad") is not None else self._eos

    def _require_id(self, token: str, what: str) -> int:
        token_id = self._tok.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"{what} {token!r} is not in the vocabulary of {self.path}")
        return token_id

    def _special_ids_from_files(self, folder: pathlib.Path) -> dict[str, int | None]:
        ids: dict[str, int | None] = {"bos": None, "eos": None, "pad": None}
        for name in ("config.json", "generation_config.json"):
            data = _read_json(folder / name)
            for role in ids:
                if ids[role] is None:
                    ids[role] = _first_id(data.get(f"{role}_token_id"))
        config = _read_json(folder / "tokenizer_config.json")
        for role in ids:
            content = _token_content(config.get(f"{role}_token"))
            if content is not None and self._tok.token_to_id(content) is not None:
                ids[role] = self._tok.token_to_id(content)  # the tokenizer's own config wins
        return ids

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
    def pad_id(self) -> int:
        return self._pad

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r})"


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
