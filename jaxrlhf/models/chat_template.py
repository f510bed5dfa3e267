"""A checkpoint's own chat template, rendered as `transformers`' `apply_chat_template` renders it.

Instruct models are trained on conversations laid out by the Jinja template shipped in
`tokenizer_config.json` (`chat_template`, or a `chat_template.jinja` file beside it, which
wins as in transformers 5). Prompting such a model with raw text samples from a distribution
it never saw, so prompts and demonstrations go through the same template. Rendering follows
transformers so the text is byte-identical: a sandboxed environment (templates from the Hub
are untrusted code) with `trim_blocks` and `lstrip_blocks`, the loop-control extension, a
`tojson` that does not HTML-escape, `raise_exception`, `strftime_now`, the `{% generation %}`
block (rendered as its body), message keys whose value is None dropped, and the tokenizer's
named special tokens (`bos_token`, `eos_token`, ...) as variables, read as transformers reads them
(`special_token_texts`: an older checkpoint's special_tokens_map.json too). The rendered text already
holds the template's BOS, so it is encoded without adding special tokens (as transformers does).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib
from typing import Any, Mapping, Sequence

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

Message = Mapping[str, Any]


class ChatTemplateError(ValueError):
    """A chat template that cannot be read or rendered, or messages it cannot take."""


def token_text(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def special_token_texts(folder: pathlib.Path, config: Mapping[str, Any]) -> dict[str, str]:
    """The named special tokens (`bos_token`, ...) as transformers loads them: those of
    tokenizer_config.json (`config`), with an older checkpoint's special_tokens_map.json over them.
    transformers reads that file only when tokenizer_config.json has no `added_tokens_decoder` (which
    every save since transformers 4.34 writes), and then each token it names replaces the config's
    (a string or {"content": ...}; null removes it)."""
    tokens = {name: config.get(name) for name in SPECIAL_TOKEN_NAMES}
    map_file = pathlib.Path(folder) / "special_tokens_map.json"
    if "added_tokens_decoder" not in config and map_file.exists():
        try:
            listed = json.loads(map_file.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise ChatTemplateError(f"cannot read {map_file}: {e}") from None
        if isinstance(listed, dict):
            tokens.update({name: listed[name] for name in SPECIAL_TOKEN_NAMES if name in listed})
    return {name: text for name, value in tokens.items() if (text := token_text(value)) is not None}


def _environment() -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for masks; renders its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template and the special-token variables it is rendered with."""

    source: str
    special_tokens: Mapping[str, str]
    origin: str = "<string>"

    def __post_init__(self):
        import jinja2

        try:
            compiled = _environment().from_string(self.source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template of {self.origin} does not parse: {e}") from None
        object.__setattr__(self, "_compiled", compiled)

    @classmethod
    def from_folder(cls, folder: str | pathlib.Path) -> "ChatTemplate | None":
        """The template a tokenizer folder ships (`chat_template.jinja`, else tokenizer_config.json's
        `chat_template`, the "default" one when it lists several), or None when it ships none."""
        folder = pathlib.Path(folder)
        config_file = folder / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if config_file.exists():
            try:
                config = json.loads(config_file.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError) as e:
                raise ChatTemplateError(f"cannot read {config_file}: {e}") from None
        special = special_token_texts(folder, config)
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.exists():
            return cls(jinja_file.read_text(encoding="utf-8"), special, str(jinja_file))
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if template is None:
            return None
        if not isinstance(template, str):
            raise ChatTemplateError(f"{config_file}: chat_template must be a string, got {type(template).__name__}")
        return cls(template, special, str(config_file))

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool = False) -> str:
        """The conversation as text; `add_generation_prompt` ends it with the assistant header."""
        import jinja2

        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                raise ChatTemplateError(f"message {i} is not a mapping with a 'role': {message!r}")
        plain = [{k: v for k, v in m.items() if v is not None} for m in messages]
        try:
            return self._compiled.render(  # type: ignore[attr-defined]
                messages=plain, tools=None, documents=None, add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"chat template of {self.origin}: {e}") from None
