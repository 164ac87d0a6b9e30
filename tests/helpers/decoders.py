"""Tiny decoder roots (a Llama-shaped model on a character tokenizer) and the texts the decoder tests send."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from hmi.model.decoder import DecoderRoot
from tests.helpers.generation import CharTokenizer


def tiny_decoder(l_low: int = 2) -> DecoderRoot:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)
    cfg._attn_implementation = "eager"
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    return DecoderRoot(model, None, l_low)


TEXTS = ["the quick brown fox jumps over the lazy dog", "a lazy dog sleeps in the sun all day long"] * 3


def tiny_decoder_root():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=90, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
    cfg._attn_implementation = "eager"
    return DecoderRoot(LlamaForCausalLM(cfg).eval().requires_grad_(False), CharTokenizer(), 2, name="tiny-decoder")
