"""Generate the small bundled data sets under jaxrlhf/data/bundled/ (deterministic).

Run `python scripts/make_bundled_data.py` after changing a generator here, then
bump the VERSION of the matching builder in jaxrlhf/data/tasks.py so prepared
copies are rebuilt. Tests check that the committed files equal this output.

Tasks are chosen so a tiny byte-level model learns them on a CPU in minutes:
- arithmetic: "a+b=" -> str(a + b), operands 0..29 (verifiable by exact match);
- reverse: "abc>" -> "cba", 2..4 letters from a-f (verifiable by exact match);
- preference: arithmetic prompts with the correct sum as `chosen` and a near
  miss as `rejected`, so a reward model trained on it agrees with the rule;
- calculator: "What is 37*86?" -> "3182", two-digit products a tiny model cannot
  compute in its head but can with the `calculator` tool (docs/agentic.md). Its
  `sft` demonstrations are conversations (`messages`, JSON text): a share of them
  call the calculator and answer with its result, the rest answer directly
  (`direct`: every problem answered without the tool, for the no-tools twin).
  Its byte-level tokenizer and chat template go to calculator_tokenizer/.
Each verifiable task has an `sft` split of demonstrations for a warm-up.
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import random

OUT_DIR = pathlib.Path(__file__).resolve().parents[1] / "jaxrlhf" / "data" / "bundled"
SEED = 20240601
NUM_SFT = 256


def _split(rows: list[dict], test_fraction: float, rng: random.Random) -> tuple[list[dict], list[dict]]:
    rows = list(rows)
    rng.shuffle(rows)
    n_test = max(1, int(len(rows) * test_fraction))
    return rows[n_test:], rows[:n_test]


def arithmetic(rng: random.Random) -> dict[str, list[dict]]:
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(30) for b in range(30)]
    train, test = _split(rows, 0.1, rng)
    return {"train": train, "test": test, "sft": rng.sample(train, NUM_SFT)}


def reverse(rng: random.Random) -> dict[str, list[dict]]:
    letters = "abcdef"
    words = ["".join(p) for n in (2, 3, 4) for p in itertools.product(letters, repeat=n)]
    rows = [{"prompt": f"{w}>", "answer": w[::-1]} for w in words]
    train, test = _split(rows, 0.1, rng)
    return {"train": train, "test": test, "sft": rng.sample(train, NUM_SFT)}


def preference(rng: random.Random) -> dict[str, list[dict]]:
    rows = []
    for a in range(30):
        for b in range(30):
            wrong = a + b + rng.choice([-3, -2, -1, 1, 2, 3, 10])
            wrong = wrong if wrong >= 0 else a + b + 1
            rows.append({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(wrong)})
    train, test = _split(rows, 0.1, rng)
    return {"train": train, "test": test}


CALCULATOR_TOOL_SHARE = 0.4  # demonstrations that call the tool; the rest answer directly (RL's room to improve)


def calculator(rng: random.Random) -> dict[str, list[dict]]:
    """Two-digit products; the demonstrations are message lists as JSON text (TFDS stores text fields)."""
    rng = random.Random(f"{SEED}-calculator")  # its own seed: the data does not depend on its place in GENERATORS
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    rows = [{"prompt": f"What is {a}*{b}?", "answer": str(a * b), "messages": "", "direct": ""}
            for a, b in rng.sample(pairs, 1200)]  # every split has the builder's fields; prompts have no demos
    train, test = _split(rows, 1 / 12, rng)
    sft = []
    for row in rng.sample(train, 400):
        user = {"role": "user", "content": row["prompt"]}
        answer = {"role": "assistant", "content": row["answer"]}
        expression = row["prompt"].removeprefix("What is ").removesuffix("?")
        call = {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}]}
        result = {"role": "tool", "name": "calculator", "content": row["answer"]}
        with_tool = [user, call, result, answer] if rng.random() < CALCULATOR_TOOL_SHARE else [user, answer]
        sft.append({**row, "messages": json.dumps(with_tool), "direct": json.dumps([user, answer])})
    return {"train": train, "test": test, "sft": sft}


# task name -> generator of {split: rows}; file names are <task>_<split>.jsonl.
GENERATORS = {"arithmetic": arithmetic, "reverse": reverse, "preference": preference,
              "calculator": calculator}

# The calculator task's chat template: ChatML turns between two special tokens, the tools listed in one compact
# system line, calls written as Hermes' <tool_call>{json}</tool_call> (models/tools.py parses them), so a
# byte-level model's prompts and trajectories stay short.
CALCULATOR_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:"
    "{%- for tool in tools %} {{ tool.function.name }}({{ tool.function.parameters.properties | list | join(',') }})"
    "{%- endfor %}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{%- for call in message.tool_calls or [] %}<tool_call>{\"name\":{{ call.function.name | tojson }},"
    "\"arguments\":{{ call.function.arguments | tojson(separators=(',', ':')) }}}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CALCULATOR_SPECIAL = ("<|im_start|>", "<|im_end|>")


def calculator_tokenizer() -> dict[str, str]:
    """A byte-level tokenizer.json (the 256 bytes, no merges) with the template's two special tokens, its
    tokenizer_config.json (EOS = <|im_end|>, which ends a turn) and chat_template.jinja."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    others = [b for b in range(256) if b not in printable]  # GPT-2's byte -> character map (ByteLevel's alphabet)
    char = {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}
    special = {token: i for i, token in enumerate(CALCULATOR_SPECIAL)}
    vocab = {**special, **{char[b]: len(special) + b for b in range(256)}}  # byte b -> id b + 2
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CALCULATOR_SPECIAL])
    config = {"eos_token": "<|im_end|>", "pad_token": "<|im_end|>", "model_max_length": 512,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    return {"tokenizer.json": json.dumps(json.loads(raw.to_str()), indent=1, sort_keys=True) + "\n",
            "tokenizer_config.json": json.dumps(config, indent=2, sort_keys=True) + "\n",
            "chat_template.jinja": CALCULATOR_TEMPLATE}


def render() -> dict[str, str]:
    """All bundled files as {file name: JSONL text}; a fresh RNG per task keeps tasks independent."""
    files = {}
    for index, (task, generate) in enumerate(GENERATORS.items()):
        for split, rows in generate(random.Random(SEED + index)).items():
            lines = (json.dumps(row, sort_keys=True) for row in rows)
            files[f"{task}_{split}.jsonl"] = "".join(line + "\n" for line in lines)
    return files


def render_tokenizers() -> dict[str, str]:
    """The bundled tokenizer folders' files as {relative path: text}."""
    return {f"calculator_tokenizer/{name}": text for name, text in calculator_tokenizer().items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=OUT_DIR)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    total = 0
    for name, text in {**render(), **render_tokenizers()}.items():
        (args.out / name).parent.mkdir(parents=True, exist_ok=True)
        (args.out / name).write_text(text, encoding="utf-8")
        total += len(text.encode())
        print(f"wrote {args.out / name} ({text.count(chr(10))} rows)")
    print(f"total {total / 1024:.1f} KiB")


if __name__ == "__main__":
    main()
