"""Tiny real transformers models saved with ``save_pretrained``: the "pretrained" sources of
the ``--hf-model`` tests (Llama untied with its own tokenizer, GPT-2 tied without one)."""

from __future__ import annotations

from pathlib import Path

VOCAB = 320


def tiny_llama(folder: Path, *, seed: int = 1, tokenizer: bool = True) -> Path:
    """LlamaForCausalLM (untied, 2 layers, GQA) and a 300-token BPE tokenizer of the demo corpus."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    if tokenizer:
        _tokenizer(folder)
    return folder


def tiny_gpt2(folder: Path, *, seed: int = 2) -> Path:
    """GPT2LMHeadModel (lm_head tied to wte, 3 layers), no tokenizer."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=3, n_head=4, n_positions=128, bos_token_id=1,
                     eos_token_id=2)
    GPT2LMHeadModel(cfg).save_pretrained(folder)
    return folder


def _tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from ckptool.train.data import demo_corpus

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([demo_corpus(1 << 14).decode()], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(folder)
