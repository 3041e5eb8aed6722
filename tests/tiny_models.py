"""Tiny random-weight transformers decoders of the families torch_marlin fuses (built from configs,
no download): the fusion and compile tests run them fused against unfused."""

import torch

from optional_packages import require

# family -> (config class, model class, extra config fields)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),  # biased q/k/v
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),  # q_norm / k_norm on the head dim
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16}),  # soft-capping, sliding layers
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16}),  # q/k norms, sliding layers
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
}


def tiny_model(family: str = "llama", layers: int = 1, seed: int = 0, vocab: int = 128):
    """An eval-mode float32 model: hidden 64, MLP 128, 4 heads of 16 with 2 key/value heads."""
    require("transformers")
    import transformers

    config_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, **extra)
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(config).eval()
