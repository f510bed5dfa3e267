"""`python -m jaxrlhf.generate`: JSON output, parity with transformers greedy generate, clean errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def _cli(*args: str) -> subprocess.CompletedProcess:
    # A fresh process: one real CPU device, no simulated ones (the CLI must work that way).
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run(
        [sys.executable, "-m", "jaxrlhf.generate", *args], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    pytest.importorskip("transformers")
    from jaxrlhf.testing.models import save_tiny_hf_checkpoint

    return save_tiny_hf_checkpoint(tmp_path_factory.mktemp("cli"), "llama", seed=0)


@pytest.mark.slow
def test_greedy_json_matches_transformers_generate(checkpoint):
    import torch
    import transformers

    res = _cli("--model", str(checkpoint), "--prompt", "hello", "--greedy", "--max-new-tokens", "12", "--json")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert set(out) == {"prompt_ids", "token_ids", "text"}
    assert out["prompt_ids"] == [1] + [b + 3 for b in b"hello"]  # byte tokenizer: BOS + bytes offset by 3
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = torch.tensor([out["prompt_ids"]])
    with torch.no_grad():
        ref = hf.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
            eos_token_id=hf.config.eos_token_id, pad_token_id=hf.config.pad_token_id,
        )
    assert out["token_ids"] == ref[0, ids.shape[1]:].tolist()
    assert 1 <= len(out["token_ids"]) <= 12


@pytest.fixture(scope="module")
def checkpoints_with_tokenizer(tmp_path_factory):
    """Tiny checkpoints with a tokenizer.json beside them. The Qwen2 one names a BOS id in config.json
    (= EOS, as Qwen2 does) that its tokenizer never adds; the Llama 3 one prepends <|begin_of_text|>."""
    pytest.importorskip("transformers")
    from jaxrlhf.testing.models import save_tiny_hf_checkpoint, save_tiny_tokenizer

    root = tmp_path_factory.mktemp("cli-tok")
    ids = {"qwen2": dict(bos_token_id=0, eos_token_id=0, pad_token_id=0),
           "llama": dict(bos_token_id=0, eos_token_id=1, extra_eos_token_ids=(3,), pad_token_id=None)}
    out = {}
    for arch, style in (("qwen2", "qwen2"), ("llama", "llama3")):
        path = save_tiny_hf_checkpoint(root, arch, seed=2, **ids[arch])
        out[style] = save_tiny_tokenizer(path, style)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("style", ["qwen2", "llama3"])
def test_prompt_ids_and_tokens_match_transformers(checkpoints_with_tokenizer, style):
    import torch
    import transformers

    path = checkpoints_with_tokenizer[style]
    res = _cli("--model", str(path), "--prompt", "the cat sat", "--greedy", "--max-new-tokens", "8", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    expected = transformers.AutoTokenizer.from_pretrained(str(path))("the cat sat")["input_ids"]
    assert out["prompt_ids"] == expected  # Qwen2: no BOS although config.json has bos_token_id
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([expected])
    with torch.no_grad():  # stop ids from generation_config.json, as transformers does by default
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8)
    assert out["token_ids"] == ref[0, ids.shape[1]:].tolist()


@pytest.mark.slow
def test_past_max_positions_is_one_clear_line(checkpoint):
    res = _cli("--model", str(checkpoint), "--prompt", "hello", "--max-new-tokens", "600", "--json")
    assert res.returncode == 2 and res.stdout == ""
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and "max_position_embeddings 512" in err[0], res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.slow
def test_sampling_flags(checkpoint):
    res = _cli("--model", str(checkpoint), "--prompt", "hi", "--temperature", "0.8", "--top-p", "0.9",
               "--top-k", "20", "--max-new-tokens", "6", "--seed", "3", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert 1 <= len(out["token_ids"]) <= 6 and all(0 <= t < 384 for t in out["token_ids"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "case, expect",
    [
        ("missing", "model directory not found"),
        ("unsupported", "GPT2LMHeadModel"),
        ("no_weights", "model.safetensors"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_2(tmp_path, case, expect):
    model_dir = tmp_path / "model"
    if case != "missing":
        model_dir.mkdir()
        arch = "GPT2LMHeadModel" if case == "unsupported" else "LlamaForCausalLM"
        (model_dir / "config.json").write_text(json.dumps({
            "architectures": [arch], "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "hidden_act": "silu", "rms_norm_eps": 1e-5,
        }))
    res = _cli("--model", str(model_dir), "--prompt", "x", "--json")
    assert res.returncode == 2
    assert res.stdout == ""
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and expect in err[0], res.stderr
    assert "Traceback" not in res.stderr


def test_greedy_excludes_sampling_flags(tmp_path):
    res = _cli("--model", str(tmp_path), "--prompt", "x", "--greedy", "--temperature", "0.5")
    assert res.returncode == 2
    assert "--greedy cannot be combined" in res.stderr
