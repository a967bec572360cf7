"""Models nobody here wrote: HuggingFace ``transformers`` models built from small configs (no
downloads, dropout off), with the data and loss a user of that library would write.

``transformers`` is imported inside the functions: it takes seconds to import, and only the ranks
and tests that train these models should pay for it.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 32
SEQ = 8
MASK_TOKEN = 1
MASKED_PER_SEQUENCE = 2
"""Every BERT sequence has the same number of masked tokens, so every rank's mean loss weighs the same
number of tokens (unequal counts are the uneven-batch tests' subject, not these)."""


def quiet_transformers() -> None:
    from transformers.utils import logging

    logging.set_verbosity_error()  # config warnings about token ids outside the tiny vocabulary


def gpt2(seed: int | None = 0) -> nn.Module:
    """GPT2LMHeadModel, 2 layers, width 16: the output head is tied to the token embedding.
    ``seed=None``: the generator as it is."""
    quiet_transformers()
    from transformers import GPT2Config, GPT2LMHeadModel

    if seed is not None:
        torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                        eos_token_id=0)
    return GPT2LMHeadModel(config)


def llama(seed: int | None = 0) -> nn.Module:
    """LlamaForCausalLM, 2 layers, width 16, grouped-query attention (1 key-value head), untied head.
    ``seed=None``: the generator as it is (a build under meta_init compared with one on the CPU)."""
    quiet_transformers()
    from transformers import LlamaConfig, LlamaForCausalLM

    if seed is not None:
        torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=2, num_attention_heads=2,
                                        num_key_value_heads=1, max_position_embeddings=16))


def lora(model: nn.Module, **options: object) -> nn.Module:
    """``model`` wrapped by peft with a rank-4 LoRA on the attention's query and value projections
    (GPT-2's fused ``c_attn``) and, where the output head is not tied to the embedding (Llama), a
    trainable copy of it (``modules_to_save``)."""
    from peft import LoraConfig, get_peft_model

    gpt2 = type(model).__name__.startswith("GPT2")
    targets = ["c_attn"] if gpt2 else ["q_proj", "v_proj"]
    head = [] if gpt2 else ["lm_head"]
    options = {"modules_to_save": head, **options}
    config = LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0,
                        **options)  # type: ignore[arg-type]
    return get_peft_model(model, config)


def _bert_config() -> object:
    from transformers import BertConfig

    return BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=32, max_position_embeddings=16, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0, pad_token_id=0)


def bert(seed: int = 0) -> nn.Module:
    """BertForMaskedLM, 2 layers, width 16: the decoder is tied to the word embedding."""
    quiet_transformers()
    from transformers import BertForMaskedLM

    torch.manual_seed(seed)
    return BertForMaskedLM(_bert_config())


def bert_classifier(seed: int = 0) -> nn.Module:
    """BertForSequenceClassification with its default 2 labels (a binary fine-tune): the head's
    2-element bias is one element per rank on 2 ranks."""
    quiet_transformers()
    from transformers import BertForSequenceClassification

    torch.manual_seed(seed)
    return BertForSequenceClassification(_bert_config())


def resnet(seed: int = 0) -> nn.Module:
    """ResNetForImageClassification, two basic stages: convolutions with BatchNorm everywhere."""
    quiet_transformers()
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(seed)
    config = ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                          layer_type="basic", num_labels=3)
    return ResNetForImageClassification(config)


def token_batch(global_batch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal LM data: ``(input_ids, labels)``, labels equal to the inputs (the model shifts them)."""
    g = torch.Generator().manual_seed(2000 + step)
    tokens = torch.randint(2, VOCAB, (global_batch, SEQ), generator=g)
    return tokens, tokens.clone()


def labelled_batch(global_batch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence classification data: ``(input_ids, labels)``, one label in {0, 1} per sequence."""
    g = torch.Generator().manual_seed(4000 + step)
    tokens = torch.randint(2, VOCAB, (global_batch, SEQ), generator=g)
    return tokens, torch.randint(0, 2, (global_batch,), generator=g)


def masked_batch(global_batch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked LM data: ``(input_ids, labels)``; ``MASKED_PER_SEQUENCE`` positions of each sequence are
    replaced by the mask token and labelled, every other label is -100 (ignored)."""
    g = torch.Generator().manual_seed(3000 + step)
    tokens = torch.randint(2, VOCAB, (global_batch, SEQ), generator=g)
    masked = torch.rand(global_batch, SEQ, generator=g).argsort(dim=1)[:, :MASKED_PER_SEQUENCE]
    labels = torch.full_like(tokens, -100)
    labels.scatter_(1, masked, tokens.gather(1, masked))
    inputs = tokens.scatter(1, masked, MASK_TOKEN)
    return inputs, labels


def image_batch(global_batch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(4000 + step)
    return torch.randn(global_batch, 3, 16, 16, generator=g), torch.randint(0, 3, (global_batch,), generator=g)
