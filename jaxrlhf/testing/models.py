"""Tiny random models and HF checkpoints for tests.

torch and transformers are test-only dependencies, so they are imported
inside the functions that need them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from flax import nnx

from jaxrlhf.models.config import PRESETS, ModelConfig
from jaxrlhf.models.transformer import build_model

_TINY = {"llama": "tiny", "qwen2": "tiny-qwen2", "mistral": "tiny-mistral"}


def tiny_config(arch: str = "llama", **overrides: Any) -> ModelConfig:
    """The tiny test preset of an architecture ("llama", "qwen2", "mistral"), with fields replaced."""
    if arch not in _TINY:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {sorted(_TINY)}")
    return PRESETS[_TINY[arch]].replace(**overrides)


def random_model(config: ModelConfig, head: str = "lm", seed: int = 0) -> nnx.Module:
    """A random model filled from numpy (no per-shape JAX compiles, so tests stay fast).

    Unlike `build_model`, norms and biases (including value / reward heads) are
    perturbed away from their 1 / 0 init, so layout mistakes cannot hide.
    """
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: build_model(config, head, seed=seed)))
    leaves = []
    for path, var in nnx.to_flat_state(state):
        struct = var.get_value()
        noise = rng.standard_normal(struct.shape, dtype=np.float32)
        name = path[-1]
        if name == "weight":  # RMSNorm scales
            value = 1.0 + 0.1 * noise
        elif str(name).endswith("_bias"):
            value = 0.1 * noise
        else:
            value = 0.02 * noise
        leaves.append((path, var.replace(value=jnp.asarray(value, struct.dtype))))
    return nnx.merge(graphdef, nnx.from_flat_state(leaves))


def hf_dims(config: ModelConfig) -> dict[str, Any]:
    """The fields every transformers decoder config takes, from `config`: dimensions, norm eps, tying and
    special ids (each family's config class adds its own; independent of hf_families)."""
    return dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads, head_dim=config.dim_per_head,
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings, bos_token_id=config.bos_token_id,
        eos_token_id=list(config.eos_token_ids) if config.extra_eos_token_ids else config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )


def hf_config(config: ModelConfig):
    """The transformers config of `config`, built with transformers' own classes (independent of hf_families)."""
    import dataclasses

    import transformers

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        rope = {"rope_type": "llama3", "rope_theta": config.rope_theta, **dataclasses.asdict(config.rope_scaling)}
    common = dict(hf_dims(config), rope_parameters=rope)
    if config.architecture == "llama":
        return transformers.LlamaConfig(architectures=["LlamaForCausalLM"], **common)
    if config.architecture == "mistral":
        return transformers.MistralConfig(
            architectures=["MistralForCausalLM"], sliding_window=config.sliding_window, **common
        )
    return transformers.Qwen2Config(
        architectures=["Qwen2ForCausalLM"], use_sliding_window=config.sliding_window is not None,
        sliding_window=config.sliding_window, max_window_layers=0, **common,
    )


def hf_model(config: ModelConfig, seed: int = 0):
    """A random float32 transformers model (eager attention) with `config`'s shapes."""
    import torch
    import transformers

    hf = hf_config(config)
    torch.manual_seed(seed)
    cls = getattr(transformers, hf.architectures[0])
    model = cls._from_config(hf, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():  # default init leaves norms at 1 and biases at 0: perturb them so the mapping is tested
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def save_tiny_hf_checkpoint(
    tmp_dir: str | os.PathLike, arch: str = "llama", seed: int = 0, **overrides: Any
) -> Path:
    """Build a tiny random transformers model of `arch`, `save_pretrained` it (safetensors), return the directory."""
    config = tiny_config(arch, **overrides)
    path = Path(tmp_dir) / f"{arch}-{seed}"
    hf_model(config, seed).save_pretrained(path, safe_serialization=True)
    return path


def left_padded_batch(
    vocab_size: int, length: int, pads: tuple[int, ...] = (0, 5, 17), seed: int = 0, pad_id: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Random tokens [len(pads), length], row i left-padded with pads[i] pad tokens; and the bool mask."""
    rng = np.random.RandomState(seed)
    tokens = rng.randint(3, vocab_size, size=(len(pads), length))
    mask = np.arange(length)[None, :] >= np.asarray(pads)[:, None]
    return np.where(mask, tokens, pad_id), mask


def jax_logits(model: nnx.Module, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Full-forward float logits of our model, positions counting real tokens only.

    Eager on purpose: op-by-op compiles are shared between the many tiny configs tests use.
    """
    import jax.numpy as jnp

    from jaxrlhf.models.transformer import positions_from_mask

    m = jnp.asarray(mask, bool)
    logits, _ = model(jnp.asarray(tokens), positions_from_mask(m), m)
    return np.asarray(logits, np.float32)


def torch_logits(hf, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Logits of a transformers model for a left-padded batch (attention_mask and matching position_ids)."""
    import torch

    positions = np.maximum(np.cumsum(mask, axis=-1) - 1, 0)
    with torch.no_grad():
        out = hf(
            input_ids=torch.as_tensor(tokens, dtype=torch.long),
            attention_mask=torch.as_tensor(mask, dtype=torch.long),
            position_ids=torch.as_tensor(positions, dtype=torch.long),
        )
    return out.logits.float().numpy()


def max_relative_error(ours: np.ndarray, ref: np.ndarray, mask: np.ndarray) -> float:
    """max |Δlogit| / max |logit| over real (unpadded) positions."""
    return float(np.abs(ours - ref)[mask].max() / np.abs(ref[mask]).max())


def load_transformers_model(path: str | os.PathLike, dtype: str = "float32"):
    """`AutoModelForCausalLM.from_pretrained` with eager attention (honours Mistral's sliding window)."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=getattr(torch, dtype)
    ).eval()


# Tiny tokenizers laid out like real checkpoints' (tokenizer.json + tokenizer_config.json).
# llama2: SentencePiece-style BPE, post-processor prepends <s>, add_bos_token=true.
# llama3: byte-level BPE, post-processor prepends <|begin_of_text|> (no add_bos_token key).
# qwen2: byte-level BPE, post-processor adds nothing; bos_token null.
_TOKENIZER_STYLES: dict[str, dict[str, Any]] = {
    "llama2": {
        "special": ["<unk>", "<s>", "</s>"], "bos": "<s>",
        "config": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
                   "add_eos_token": False, "legacy": False, "tokenizer_class": "LlamaTokenizerFast"},
    },
    "llama3": {
        "special": ["<|begin_of_text|>", "<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"], "bos": "<|begin_of_text|>",
        "config": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                   "tokenizer_class": "PreTrainedTokenizerFast"},
    },
    "qwen2": {
        "special": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "bos": None,
        "config": {"bos_token": None, "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                   "add_prefix_space": False, "tokenizer_class": "Qwen2Tokenizer"},
    },
}
TOKENIZER_STYLES = tuple(_TOKENIZER_STYLES)
# Qwen2's pre-tokenizer split (digits one by one), as in its published tokenizer.json.
_QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)
_TOKENIZER_CORPUS = ["the cat sat on the mat", "a dog and a cat", "12 + 7 = 19", "hello world, héllo ✓"] * 20


def save_tiny_tokenizer(folder: str | os.PathLike, style: str = "qwen2", vocab_size: int = 300,
                        corpus: Sequence[str] = ()) -> Path:
    """Train a tiny BPE tokenizer in `style` (see TOKENIZER_STYLES), save tokenizer.json and
    tokenizer_config.json into `folder` (created), return the folder. Special tokens get ids 0, 1, ...
    `corpus` adds training text (the llama2 style knows only the characters it was trained on)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    spec = _TOKENIZER_STYLES[style]
    special = spec["special"]
    if style == "llama2":  # SentencePiece-converted BPE (no byte tokens here, so keep to the corpus' characters)
        raw = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
        raw.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
        raw.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.Strip(" ", 1, 0)])
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special)
    else:
        raw = Tokenizer(models.BPE())
        raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        if style == "qwen2":  # Qwen2's own pipeline, which transformers' Qwen2Tokenizer rebuilds on load
            raw.normalizer = normalizers.NFC()
            raw.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
        raw.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    raw.train_from_iterator([*_TOKENIZER_CORPUS, *list(corpus) * 20], trainer)
    byte_level = processors.ByteLevel(trim_offsets=False)
    if spec["bos"] is None:
        raw.post_processor = byte_level
    else:
        bos = spec["bos"]
        template = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, raw.token_to_id(bos))]
        )
        raw.post_processor = template if style == "llama2" else processors.Sequence([byte_level, template])
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    raw.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(spec["config"], indent=2) + "\n")
    return folder
