"""Writes a Llama model with random weights as a safetensors folder, larger than the default model and
without GGUF codes: how the engines compare on plain float weights, as most models are shipped.

    python bench/random_model.py OUT_DIR                      # about 415M parameters, bfloat16
    python bench/random_model.py OUT_DIR --layers 8 --dtype float32

It has SmolLM2's tokenizer and vocabulary (49,152 tokens), so the throughput bench's traces fit it
(`python bench/throughput.py --model OUT_DIR`); its outputs are noise, but every system computes the
same noise, which the bench's token check compares. Seeded: the same arguments write the same weights.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--hidden-size", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--intermediate-size", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.hidden_size % args.heads or args.heads % args.kv_heads:
        ap.error("--hidden-size must be a multiple of --heads, and --heads of --kv-heads")

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from shared.config import default_model_path, split_model_path
    folder, gguf = split_model_path(default_model_path())
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    config = LlamaConfig(vocab_size=49152, hidden_size=args.hidden_size, num_hidden_layers=args.layers,
                         intermediate_size=args.intermediate_size, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, head_dim=args.hidden_size // args.heads,
                         max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config).to(getattr(torch, args.dtype))
    os.makedirs(args.out_dir, exist_ok=True)
    model.save_pretrained(args.out_dir)
    tokenizer.save_pretrained(args.out_dir)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out_dir}: {params / 1e6:.0f}M parameters, {args.dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
