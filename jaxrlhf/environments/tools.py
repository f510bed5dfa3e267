"""The built-in tool environment (`env.name: tools`): the model calls Python tools, parsed in its chat
template family's format (`environments.tool_calls`), and sees their results through its chat template.

No JAX, so config validation can check tool names (`TOOLS`).
"""

from __future__ import annotations

import ast
import dataclasses
import math
import operator
from typing import Any, Callable, Mapping, Sequence

from jaxrlhf.environments.base import EnvironmentContext, Observation, StepResult, register_environment
from jaxrlhf.registry import Registry


def _arithmetic(node: ast.AST) -> float:
    binary = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
    if isinstance(node, ast.Expression):
        return _arithmetic(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _arithmetic(node.operand)
        return value if isinstance(node.op, ast.UAdd) else -value
    if isinstance(node, ast.BinOp) and type(node.op) in binary:
        left, right = _arithmetic(node.left), _arithmetic(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 1e6):
            raise ValueError("exponent too large (at most 64, base at most 1e6)")
        return binary[type(node.op)](left, right)
    raise ValueError(f"unsupported expression element {type(node).__name__} (numbers, + - * / // % ** and "
                     "parentheses only)")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "(3 + 4) * 2".
    """
    value = _arithmetic(ast.parse(expression.strip(), mode="eval"))
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    return str(value)


# Python tools an environment may offer by name (`env.args.tools`); each is described to the model by
# `jaxrlhf.models.tool_schema.function_schema` (type hints and a Google-style docstring).
TOOLS: Registry[Callable[..., Any]] = Registry("tool", entries={"calculator": calculator})
register_tool = TOOLS.register


class ToolEnvironment:
    """The model calls Python tools: its calls are parsed in its template family's format, run, and their
    results shown as `tool` messages rendered by its chat template. The observation's text is exactly what
    `apply_chat_template` adds to the conversation after the model's turn (the tool turn and the next
    assistant header), so the trajectory's text equals the rendered conversation.

    A turn without tool calls ends the episode; its reward is `reward(row, final_text)` when given (the hook a
    task uses to score the answer), else 0. A bad call (`ToolCallError`) or a tool that raised becomes an
    error observation and is counted: `malformed_tool_call`, `malformed_tool_call/<kind>`, `tool_error`;
    `tool_calls` counts the calls run."""

    def __init__(self, context: EnvironmentContext, tools: Sequence[str | Callable[..., Any]] = ("calculator",),
                 system: str | None = None, prompt_key: str = "prompt",
                 reward: Callable[[Mapping[str, Any], str], float] | None = None):
        if context.chat_template is None:
            raise ValueError("env.name=tools needs a chat template that renders tools (a checkpoint's tokenizer "
                             "with one, e.g. Qwen2.5-Instruct)")
        if context.tool_format is None:
            raise ValueError("env.name=tools: the chat template's tool-call format is not known; set "
                             "env.args.tool_format (one of hermes, qwen2.5, qwen3, llama3.1)")
        if not context.end_of_turn:
            raise ValueError("env.name=tools needs the end-of-turn texts (the tokenizer's EOS tokens)")
        self.template = context.chat_template
        self.family = context.tool_format
        self.end_of_turn = tuple(context.end_of_turn)
        self.tools = {t: TOOLS.get(t) for t in tools if isinstance(t, str)}
        self.tools.update({t.__name__: t for t in tools if not isinstance(t, str)})
        self.system = system
        self.prompt_key = prompt_key
        self.reward = reward
        self.messages: list[dict[str, Any]] = []
        self.row: Mapping[str, Any] = {}

    def _render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool) -> str:
        return self.template.render(messages, add_generation_prompt=add_generation_prompt,
                                    tools=list(self.tools.values()))

    def reset(self, row: Mapping[str, Any]) -> Observation:
        self.row = row
        messages = row.get("messages")
        if messages is None:
            messages = [{"role": "user", "content": str(row[self.prompt_key])}]
        self.messages = ([{"role": "system", "content": self.system}] if self.system else []) + list(messages)
        return Observation(self._render(self.messages, add_generation_prompt=True))

    def _run(self, name: str, arguments: Mapping[str, Any]) -> tuple[str, bool]:
        try:
            return str(self.tools[name](**arguments)), True
        except Exception as e:  # the tool's failure is the model's observation, not the trainer's crash
            return f"Error: {name} raised {type(e).__name__}: {e}", False

    def step(self, action_text: str) -> StepResult:
        from jaxrlhf.environments.tool_calls import parse_tool_calls

        parsed = parse_tool_calls(action_text, self.family, list(self.tools.values()))
        info: dict[str, float] = {}
        before = self._render(self.messages, add_generation_prompt=True)
        if not parsed.ok:
            info["malformed_tool_call"] = 1.0
            info[f"malformed_tool_call/{parsed.kind}"] = 1.0
            turn = [{"role": "assistant", "content": action_text},
                    {"role": "tool", "content": parsed.observation}]
        elif not parsed.calls:
            self.messages.append(parsed.assistant_message())
            reward = 0.0 if self.reward is None else float(self.reward(self.row, parsed.content))
            return StepResult(None, reward, True, info)
        else:
            results = [self._run(c.name, c.arguments) for c in parsed.calls]
            info["tool_calls"] = float(len(results))
            info["tool_error"] = float(sum(not ok for _, ok in results))
            turn = [parsed.assistant_message(),
                    *({"role": "tool", "name": c.name, "content": text} for c, (text, _) in zip(parsed.calls, results))]
        self.messages += turn
        after = self._render(self.messages, add_generation_prompt=True)
        return StepResult(Observation(self._observation_text(before, after)), 0.0, False, info)

    def _observation_text(self, before: str, after: str) -> str:
        """What follows the model's turn in `after`: the text after the first end-of-turn token past the
        assistant header that `before` ends with (the model sampled everything up to and including it)."""
        if not after.startswith(before):
            raise ValueError(f"chat template of {self.template.origin}: rendering the conversation after a tool turn "
                             "does not extend the one before it, so the observation has no exact tokens")
        ends = [i for i in (after.find(eot, len(before)) for eot in self.end_of_turn) if i >= 0]
        if not ends:
            raise ValueError(f"chat template of {self.template.origin}: the assistant turn is not closed by any of "
                             f"the end-of-turn tokens {list(self.end_of_turn)}")
        end = min(ends)
        eot = next(e for e in self.end_of_turn if after.startswith(e, end))
        return after[end + len(eot):]


def answer_reward(rule: str) -> Callable[[Mapping[str, Any], str], float]:
    """A rule reward named in `rules.REWARD_FUNCTIONS` (e.g. exact_match) as the tool environment's `reward`: it
    scores the episode's final answer (the last turn, without calls) against the row's `answer`."""
    from jaxrlhf.rewards.rules import get_reward

    score = get_reward(rule)
    return lambda row, text: float(score(prompt=str(row.get("prompt", "")), response=text, answer=row.get("answer")))


@register_environment("tools")
def tools_environment(context: EnvironmentContext, **args: Any) -> ToolEnvironment:
    """`env.name: tools`: a `ToolEnvironment` over the tools named in `env.args.tools` (`TOOLS`); `env.args.reward`
    may name a rule that scores the final answer (`answer_reward`)."""
    if "tool_format" in args:
        context = dataclasses.replace(context, tool_format=args.pop("tool_format"))
    if isinstance(args.get("reward"), str):
        args["reward"] = answer_reward(args["reward"])
    return ToolEnvironment(context, **args)
