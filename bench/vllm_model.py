"""A Llama for vLLM made here, offline: config, random weights, a tokenizer.

    python bench/vllm_model.py DIR [--shape llama-2b|tiny] [--dtype bfloat16] [--seed 0]

Writes ``config.json``, ``model.safetensors`` (random weights, normal with
std 0.02, norms at 1) and a byte-level BPE tokenizer trained on the spot on
a synthetic corpus (``tokenizer.json``, ``tokenizer_config.json``), so that
vLLM's OpenAI server runs with no network.  The model's vocabulary is the
tokenizer's, exactly: any token the model emits can be decoded.

Shapes:

* ``llama-2b``: Llama-3.2-3B's layer (hidden 3072, 24 heads of 128, 8 KV
  heads, MLP 8192), 20 layers, a 32000-token vocabulary: 2.2 B parameters,
  4.1 GiB in bf16.  Big enough that loading it from disk takes seconds.
* ``tiny``: 2 layers of hidden 256 (4 heads of 64: a head size every
  FlashAttention build has), a 1024-token vocabulary.  For the GPU tests.

Weights are drawn on the GPU when there is one (seconds for 2 B values).
Prints one JSON line: the folder, parameter count, bytes, seconds.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

SHAPES = {
    "llama-2b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=20, num_attention_heads=24,
                     num_key_value_heads=8, head_dim=128, vocab_size=32000, max_position_embeddings=8192),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, vocab_size=1024, max_position_embeddings=2048),
}
SPECIALS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2


def corpus(words: int, seed: int) -> list[str]:
    """Lines of made-up words from syllables: plenty of distinct pairs for BPE to merge."""
    rng = random.Random(seed)
    onsets = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
              "br", "ch", "dr", "gl", "kr", "pl", "qu", "sh", "st", "th", "tr"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "io", "ou", "y"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "rk", "ng"]
    lexicon = ["".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
                       for _ in range(rng.randint(1, 4))) for _ in range(60000)]
    lines, line = [], []
    for _ in range(words):
        line.append(rng.choice(lexicon) if rng.random() < 0.9 else str(rng.randint(0, 9999)))
        if len(line) == 12:
            lines.append(" ".join(line) + rng.choice([".", ",", "!", "?", ";"]))
            line = []
    return lines


def train_tokenizer(folder: Path, vocab_size: int, seed: int) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(400_000 if vocab_size > 4096 else 40_000, seed), trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "pad_token": "<pad>", "model_max_length": 1 << 20, "clean_up_tokenization_spaces": False}))
    return tok.get_vocab_size()


def tensor_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    h, i, heads, kv, d = (c["hidden_size"], c["intermediate_size"], c["num_attention_heads"],
                          c["num_key_value_heads"], c["head_dim"])
    shapes = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,),
              "lm_head.weight": (c["vocab_size"], h)}
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (heads * d, h), p + "self_attn.k_proj.weight": (kv * d, h),
            p + "self_attn.v_proj.weight": (kv * d, h), p + "self_attn.o_proj.weight": (h, heads * d),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
        })
    return shapes


def make_model(folder: Path, shape: str = "llama-2b", dtype: str = "bfloat16", seed: int = 0) -> dict:
    import torch
    from safetensors.torch import save_file

    started = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    c = dict(SHAPES[shape])
    c["vocab_size"] = train_tokenizer(folder, c["vocab_size"], seed)
    tokenizer_s = time.perf_counter() - started
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": dtype, "dtype": dtype,
              "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
              "attention_bias": False, "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2,
              "pad_token_id": 0, "initializer_range": 0.02, **c}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device=device).manual_seed(seed)
    tensors, count = {}, 0
    for name, shape_ in tensor_shapes(c).items():
        if len(shape_) == 1:
            t = torch.ones(shape_, dtype=getattr(torch, dtype))
        else:
            t = (torch.randn(shape_, generator=generator, device=device) * 0.02).to(getattr(torch, dtype)).cpu()
        tensors[name] = t
        count += t.numel()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    nbytes = (folder / "model.safetensors").stat().st_size
    return {"folder": str(folder), "shape": shape, "dtype": dtype, "parameters": count, "bytes": nbytes,
            "vocab_size": c["vocab_size"], "tokenizer_s": round(tokenizer_s, 2),
            "seconds": round(time.perf_counter() - started, 2), "weights_drawn_on": device}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--shape", default="llama-2b", choices=sorted(SHAPES))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print(json.dumps(make_model(args.folder, args.shape, args.dtype, args.seed)), flush=True)


if __name__ == "__main__":
    main()
