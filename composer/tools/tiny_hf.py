"""Write a tiny random Hugging Face model folder with transformers (no hub), for
trying the HF-backed family on a laptop:

    composer-tiny-hf [--arch llama|qwen2|mistral] [--out ./outputs/tiny_hf]
    torchrun --nproc_per_node=2 -m composer.train --config train_configs/hf_lora_debug.toml

The folder holds config.json and model.safetensors (float32), as ``save_pretrained``
writes them; its vocabulary fits composer's byte tokenizer.
"""
from __future__ import annotations

import argparse
import sys

import torch

SIZES = dict(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
             tie_word_embeddings=False)


def make(arch: str, out: str, seed: int = 0) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(seed)
    config = AutoConfig.for_model(arch, **SIZES)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llama", choices=("llama", "qwen2", "mistral"))
    parser.add_argument("--out", default="./outputs/tiny_hf")
    args = parser.parse_args(argv)
    make(args.arch, args.out)
    print(f"wrote a random {args.arch} model to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
