"""Writes the embedded SmolLM2 GGUF as a float32 safetensors folder (config, weights, tokenizer).

    python bench/gguf_to_safetensors.py OUT_DIR

A model loaded from GGUF refuses `save_pretrained`, so its state dict is copied into a fresh
model built from the same config, and that one is saved. Used by bench/vllm_setup.sh: vLLM then
loads the very weights transformers and pagedserve load.
"""
from __future__ import annotations

import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(out_dir: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.config import default_model_path, split_model_path
    folder, gguf = split_model_path(default_model_path())
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
    config = copy.deepcopy(loaded.config)
    # the weights are dequantized to float32 on load; a saved "quant_method: gguf" would make other
    # loaders (vLLM) look for a GGUF file that the folder does not hold
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    # tied embeddings show up as a missing lm_head; anything else means the copy is not the model
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    fresh.tie_weights()
    fresh.generation_config = loaded.generation_config
    os.makedirs(out_dir, exist_ok=True)
    fresh.save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(folder, gguf_file=gguf).save_pretrained(out_dir)
    with torch.inference_mode():   # the saved folder must give the GGUF model's logits
        ids = torch.tensor([[1, 2, 3, 4, 5]])
        reloaded = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
        assert torch.equal(loaded(ids).logits, reloaded(ids).logits), "saved weights differ from the GGUF's"
    print(f"wrote {out_dir}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
