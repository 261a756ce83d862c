"""Tiny random models of each supported architecture, and a byte-level tokenizer with a chat template."""

from __future__ import annotations

import functools
import random

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@functools.lru_cache(maxsize=1)
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: 256 byte tokens + 3 specials, no merges (fast, offline, deterministic)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for s in SPECIALS:
        vocab[s] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    tok.chat_template = CHATML
    return tok


ARCHS = ["llama", "mistral", "qwen2", "qwen3"]


def tiny_config(arch: str, rope_scaling: dict | None = None, layers: int = 3):
    tok = tiny_tokenizer()
    common = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if rope_scaling:
        rope = {**rope, **rope_scaling}
    if arch == "llama":
        return LlamaConfig(**common, rope_parameters=rope)
    if arch == "mistral":
        return MistralConfig(**common, rope_parameters=rope, sliding_window=None)
    if arch == "qwen2":
        return Qwen2Config(**common, rope_parameters=rope, use_sliding_window=False)
    if arch == "qwen3":
        return Qwen3Config(**common, rope_parameters=rope, use_sliding_window=False)
    raise ValueError(arch)


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}


def tiny_model(arch: str = "llama", seed: int = 0, rope_scaling: dict | None = None, attn: str = "sdpa", layers: int = 3):
    torch.manual_seed(seed)
    cfg = tiny_config(arch, rope_scaling, layers)
    cfg._attn_implementation = attn
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if arch == "qwen2":  # random init leaves biases at 0; make the qkv bias actually matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    return model.eval()


# Three short chunks and a question shared by tests that only need "some chunks" on a tiny model.
def _three_chunks():
    from kvrag import Chunk

    return [
        Chunk("a", "The cat sat on the mat and purred all afternoon."),
        Chunk("b", "Volcanoes erupt lava, ash and gas from deep below.", title="Geology"),
        Chunk("c", "Stock markets rose today after the central bank spoke."),
    ]


THREE_CHUNKS = _three_chunks()
THREE_IDS = [c.id for c in THREE_CHUNKS]
THREE_Q = "What did the cat do?"


def qa_rows(n=6, seed=0):
    """Multi-passage QA rows shaped like shared/data/*.jsonl (gold passage moves), for training tests."""
    rng = random.Random(seed)
    words = ["cat", "mat", "sun", "sea", "red", "owl", "fig", "jam"]
    out = []
    for i in range(n):
        ans = rng.choice(words)
        ctxs = [{"title": f"T{j}", "text": " ".join(rng.choice(words) for _ in range(6 + (i + j) % 5))} for j in range(4)]
        ctxs[i % 4]["text"] += f" The answer is {ans}."
        out.append({"id": f"r{i}", "question": f"What is answer {i}?", "answers": [ans], "ctxs": ctxs, "gold_index": i % 4, "source": "synthetic"})
    return out
