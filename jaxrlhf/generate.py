"""Generate text from a Hugging Face checkpoint directory.

    python -m jaxrlhf.generate --model DIR --prompt TEXT [--max-new-tokens N]
        [--greedy | --temperature T --top-p P --top-k K] [--seed S] [--json]

Conventions (chosen to match `transformers` `generate`):
- the prompt is the tokenizer's encoding of TEXT with the special tokens the
  tokenizer itself puts before a text: BOS for Llama-style tokenizers and the
  byte tokenizer, nothing for Qwen2-style ones (`AutoTokenizer` does the same);
- generation stops at any of the model's EOS ids (config.json and
  generation_config.json may list several); `token_ids` are the generated ids
  only and include that EOS when it was produced (HF does the same);
- a prompt whose length plus --max-new-tokens exceeds the model's
  max_position_embeddings is an error, not silently degraded output;
- without `--greedy`, tokens are sampled (temperature 1, no top-k/top-p
  unless given) with `--seed`.
The tokenizer is DIR/tokenizer.json when present, else the built-in byte
tokenizer. `--json` prints exactly one JSON object
`{"prompt_ids": [...], "token_ids": [...], "text": "..."}` on stdout.
Bad input prints one `error: ...` line on stderr and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

EXIT_BAD_INPUT = 2


class _BadInput(Exception):
    """Input the user can fix; reported as one line, no traceback."""


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxrlhf.generate", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="HF checkpoint directory (config.json + *.safetensors)")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--greedy", action="store_true", help="argmax decoding (excludes the sampling flags)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (default 1.0)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus mass in (0, 1] (default 1.0 = off)")
    p.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (default 0 = off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    args = p.parse_args(argv)
    if args.greedy and any(v is not None for v in (args.temperature, args.top_p, args.top_k)):
        p.error("--greedy cannot be combined with --temperature, --top-p or --top-k")
    if args.max_new_tokens < 1:
        p.error("--max-new-tokens must be >= 1")
    return args


def _sampling(args: argparse.Namespace):
    from jaxrlhf.models.sampling import SamplingParams

    if args.greedy:
        return SamplingParams(greedy=True)
    try:
        return SamplingParams(
            temperature=1.0 if args.temperature is None else args.temperature,
            top_k=0 if args.top_k is None else args.top_k,
            top_p=1.0 if args.top_p is None else args.top_p,
        )
    except ValueError as e:
        raise _BadInput(str(e)) from None


def run(args: argparse.Namespace) -> dict:
    """Load the checkpoint and tokenizer, generate, return the JSON-able result."""
    model_dir = Path(args.model)
    if not model_dir.is_dir():
        raise _BadInput(f"model directory not found: {model_dir}")
    sampling = _sampling(args)

    from jaxrlhf.models.generation import GenerationError, generate
    from jaxrlhf.models.hf_io import CheckpointError, load_hf_checkpoint
    from jaxrlhf.models.tokenizer import TokenizerError, load_tokenizer, prompt_prefix

    try:
        model, config = load_hf_checkpoint(model_dir, head="lm")
        tok = load_tokenizer(model_dir / "tokenizer.json" if (model_dir / "tokenizer.json").exists() else "byte")
    except (CheckpointError, TokenizerError) as e:
        raise _BadInput(str(e)) from None

    prompt_ids = prompt_prefix(tok) + list(tok.encode(args.prompt))
    if not prompt_ids:
        raise _BadInput("the prompt is empty and the tokenizer puts no BOS token before it")
    if max(prompt_ids) >= config.vocab_size:
        raise _BadInput(
            f"tokenizer produces id {max(prompt_ids)} but the model's vocab_size is {config.vocab_size}"
        )
    eos_ids = config.eos_token_ids or tok.eos_ids
    pad_id = config.pad_token_id if config.pad_token_id is not None else tok.pad_id
    try:
        out = generate(model, [prompt_ids], args.max_new_tokens, sampling, args.seed, eos_id=eos_ids, pad_id=pad_id)
    except GenerationError as e:
        raise _BadInput(str(e)) from None
    n = int(out.lengths[0])
    token_ids = [int(t) for t in out.response_tokens[0, :n]]
    return {"prompt_ids": prompt_ids, "token_ids": token_ids, "text": tok.decode(token_ids)}


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m jaxrlhf.generate`: exit 0, or 2 with one line for a user's mistake (see jaxrlhf.errors)."""
    from jaxrlhf.errors import run_cli

    return run_cli("jaxrlhf.generate", _main, argv)


def _main(argv: Sequence[str]) -> int:
    args = _parse_args(argv)
    try:
        result = run(args)
    except _BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.json:
        print(json.dumps(result))
    else:
        print(result["text"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
