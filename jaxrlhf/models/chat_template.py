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

Tool calling renders as transformers renders it too (docs/agentic.md, "Tool calling"): `render(...,
tools=...)` takes JSON-schema dicts or Python functions (described by `jaxrlhf.models.tool_schema`), picks a
checkpoint's "tool_use" template when it names one, passes `documents` and extra variables (e.g.
`enable_thinking`) to the template, and every input goes through transformers' rebuilding of template data
(plain JSON types; a message's reasoning under `reasoning_content`, `thinking` and `reasoning`).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib
import sys
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

    class TemplateDict:
        """`dict(...)` and `dict.fromkeys(...)` only, as transformers gives templates."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """A `namespace()` that refuses underscore-prefixed attributes, as transformers' does."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


def _plain(value: Any) -> Any:
    """What a template may see, as transformers rebuilds it (`_plain_template_data`): JSON scalars (subclasses
    such as enums stripped to the base type), mappings, lists, tuples, numpy scalars as Python ones,
    dataclasses and pydantic models as dicts, anything else as a "<TypeName>" placeholder."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    numpy = sys.modules.get("numpy")  # a numpy value exists only where numpy is imported
    if numpy is not None and isinstance(value, numpy.generic):
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


# A message's reasoning goes under all three names (as transformers does): templates read `reasoning_content`
# (Qwen3, DeepSeek-R1) or `thinking` (gpt-oss).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template and the special-token variables it is rendered with. A checkpoint may ship
    several templates by name (tokenizer_config.json's list, or additional_chat_templates/*.jinja):
    `source` is the "default" one (None when it names none), `named` the others (e.g. "tool_use", which
    `render` picks when it is given tools, as transformers does)."""

    source: str | None
    special_tokens: Mapping[str, str]
    origin: str = "<string>"
    named: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        import jinja2

        env = _environment()
        compiled = {}
        templates = {"default": self.source} if self.source is not None else {}
        for name, text in {**templates, **self.named}.items():
            if not isinstance(text, str):
                raise ChatTemplateError(f"chat template {name!r} of {self.origin} must be a string, "
                                        f"got {type(text).__name__}")
            try:
                compiled[name] = env.from_string(text)
            except jinja2.exceptions.TemplateSyntaxError as e:
                label = "chat template" if name == "default" else f"chat template {name!r}"
                raise ChatTemplateError(f"{label} of {self.origin} does not parse: {e}") from None
        if not compiled:
            raise ChatTemplateError(f"{self.origin} holds no chat template")
        object.__setattr__(self, "_compiled", compiled)

    def __reduce__(self):  # pickles as its texts (compiled jinja templates do not), e.g. to environment workers
        return (type(self), (self.source, dict(self.special_tokens), self.origin, dict(self.named)))

    @classmethod
    def from_folder(cls, folder: str | pathlib.Path) -> "ChatTemplate | None":
        """The templates a tokenizer folder ships, read as transformers reads them, or None when it ships none:
        `chat_template.jinja` (the default) and `additional_chat_templates/<name>.jinja` when any of these files
        exists, else tokenizer_config.json's `chat_template` (a string, or a list of {"name", "template"})."""
        folder = pathlib.Path(folder)
        config_file = folder / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if config_file.exists():
            try:
                config = json.loads(config_file.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError) as e:
                raise ChatTemplateError(f"cannot read {config_file}: {e}") from None
        special = special_token_texts(folder, config)
        files: dict[str, pathlib.Path] = {}
        if (folder / "chat_template.jinja").exists():
            files["default"] = folder / "chat_template.jinja"
        extra_dir = folder / "additional_chat_templates"
        if extra_dir.is_dir():
            files.update({f.name.removesuffix(".jinja"): f for f in sorted(extra_dir.glob("*.jinja"))})
        if files:  # template files win over the config's entry
            texts = {name: f.read_text(encoding="utf-8") for name, f in files.items()}
            origin = str(files["default"]) if list(files) == ["default"] else str(folder)
            return cls(texts.pop("default", None), special, origin, texts)
        template = config.get("chat_template")
        if template is None:
            return None
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            if not all(isinstance(t, dict) and isinstance(t.get("name"), str) and "template" in t for t in template):
                raise ChatTemplateError(f"{config_file}: a chat_template list holds {{\"name\", \"template\"}} "
                                        "entries")
            named = {t["name"]: t["template"] for t in template}
            return cls(named.pop("default", None), special, str(config_file), named)
        if not isinstance(template, str):
            raise ChatTemplateError(f"{config_file}: chat_template must be a string, got {type(template).__name__}")
        return cls(template, special, str(config_file))

    @property
    def tool_source(self) -> str | None:
        """The text of the template `render` uses when given tools (`tools.detect_tool_format` reads it)."""
        return self.named.get("tool_use", self.source)

    def select(self, tools: Sequence[Any] | None = None) -> str:
        """The name of the template `render` uses: "tool_use" when tools are given (even none) and the
        checkpoint names one, else "default" (transformers' `get_chat_template`)."""
        if self.named and tools is not None and "tool_use" in self.named:
            return "tool_use"
        if self.source is not None:
            return "default"
        raise ChatTemplateError(f"{self.origin} has several chat templates and no default: "
                                f"{sorted(self.named)}")

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool = False,
               tools: Sequence[Any] | None = None, documents: Sequence[Mapping[str, Any]] | None = None,
               **extra: Any) -> str:
        """The conversation as text, as `apply_chat_template(messages, tools=..., documents=..., tokenize=False,
        **extra)`: `add_generation_prompt` ends it with the assistant header; `tools` are JSON-schema dicts or
        functions (`jaxrlhf.models.tool_schema.tool_schema`; one it cannot describe raises `ToolSchemaError`);
        assistant messages may carry `tool_calls` ([{"type": "function", "function": {"name", "arguments":
        {...}}}]) and `reasoning_content` (also read as `thinking` / `reasoning`), tool results come as
        {"role": "tool", "content": ...}; `extra` goes to the template as variables (e.g. Qwen3's
        `enable_thinking=False`), over the special tokens of the same name."""
        import jinja2

        from jaxrlhf.models.tool_schema import tool_schema

        if not messages:
            raise ChatTemplateError("cannot render an empty conversation")
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                raise ChatTemplateError(f"message {i} is not a mapping with a 'role': {message!r}")
        plain = [_alias_reasoning(_plain({k: v for k, v in m.items() if v is not None})) for m in messages]
        schemas = None if tools is None else _plain([tool_schema(t) for t in tools])
        if documents is not None:
            for document in documents:
                if not isinstance(document, Mapping):
                    raise ChatTemplateError(f"documents are mappings (with 'title' and 'text'), got {document!r}")
            documents = _plain(list(documents))
        variables = _plain({**self.special_tokens, **extra})
        template = self._compiled[self.select(tools)]  # type: ignore[attr-defined]
        try:
            return template.render(messages=plain, tools=schemas, documents=documents,
                                   add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"chat template of {self.origin}: {e}") from None
