"""Generate the small bundled data sets under jaxrlhf/data/bundled/ (deterministic).

Run `python scripts/make_bundled_data.py` after changing a generator here, then
bump the VERSION of the matching builder in jaxrlhf/data/tasks.py so prepared
copies are rebuilt. Tests check that the committed files equal this output.

Tasks are chosen so a tiny byte-level model learns them on a CPU in minutes:
- arithmetic: "a+b=" -> str(a + b), operands 0..29 (verifiable by exact match);
- reverse: "abc>" -> "cba", 2..4 letters from a-f (verifiable by exact match);
- preference: arithmetic prompts with the correct sum as `chosen` and a near
  miss as `rejected`, so a reward model trained on it agrees with the rule.
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


# task name -> generator of {split: rows}; file names are <task>_<split>.jsonl.
GENERATORS = {"arithmetic": arithmetic, "reverse": reverse, "preference": preference}


def render() -> dict[str, str]:
    """All bundled files as {file name: JSONL text}; a fresh RNG per task keeps tasks independent."""
    files = {}
    for index, (task, generate) in enumerate(GENERATORS.items()):
        for split, rows in generate(random.Random(SEED + index)).items():
            lines = (json.dumps(row, sort_keys=True) for row in rows)
            files[f"{task}_{split}.jsonl"] = "".join(line + "\n" for line in lines)
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=OUT_DIR)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    total = 0
    for name, text in render().items():
        (args.out / name).write_text(text, encoding="utf-8")
        total += len(text.encode())
        print(f"wrote {args.out / name} ({text.count(chr(10))} rows)")
    print(f"total {total / 1024:.1f} KiB")


if __name__ == "__main__":
    main()
