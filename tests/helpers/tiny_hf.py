"""A tiny Hugging Face GPT-2 (tied embeddings, biases, LayerNorm) built from a config: random weights, no download."""

from __future__ import annotations

import torch

VOCAB = 64


def gpt2(seed: int = 0, positions: int = 16):
    """GPT-2 with 2 layers of width 16, ``VOCAB`` tokens, end-of-text token 0, dropout off."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=positions, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config)
