"""Tiny models of the families users train, built from configs (nothing is downloaded), and the
Trainer override that transformers users write.

Each entry builds a seeded model and a small dataset of dict batches; ``ZOO`` names them. The
models are a few thousand parameters so that compiling and training each takes seconds."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch


def missing(package: str):
    """Why a zoo entry cannot run here (its package is not installed), or None."""
    if importlib.util.find_spec(package) is None:
        return f"{package} is not installed (pip install fasttrain[dev])"
    return None


def _tokens(count, length, vocab, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=generator)


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    return LlamaForCausalLM(config)


def _bert():
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16, num_labels=3,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForSequenceClassification(config)


def _vit():
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=2,
                       num_attention_heads=2, intermediate_size=32, num_labels=3,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return ViTForImageClassification(config)


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_decoder_layers=2,
                      num_heads=2, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    return T5ForConditionalGeneration(config)


def _causal_batches(count, seed=0):
    ids = _tokens(count, 8, 64, seed)
    return [{"input_ids": row, "labels": row} for row in ids]


def _classify_batches(count, seed=0):
    ids = _tokens(count, 8, 64, seed)
    labels = torch.randint(0, 3, (count,), generator=torch.Generator().manual_seed(seed + 1))
    return [{"input_ids": row, "labels": label} for row, label in zip(ids, labels)]


def _image_batches(count, seed=0):
    generator = torch.Generator().manual_seed(seed)
    images = torch.randn(count, 3, 8, 8, generator=generator)
    labels = torch.randint(0, 3, (count,), generator=generator)
    return [{"pixel_values": image, "labels": label} for image, label in zip(images, labels)]


def _seq2seq_batches(count, seed=0):
    source = _tokens(count, 8, 64, seed)
    target = _tokens(count, 6, 64, seed + 1)
    return [{"input_ids": s, "labels": t} for s, t in zip(source, target)]


@dataclass(frozen=True)
class ZooModel:
    name: str
    package: str
    build: Callable[[], torch.nn.Module]
    data: Callable[..., list]

    def make(self, seed=0):
        torch.manual_seed(seed)
        return self.build()


ZOO = {
    entry.name: entry
    for entry in (
        ZooModel("gpt2", "transformers", _gpt2, _causal_batches),
        ZooModel("llama", "transformers", _llama, _causal_batches),
        ZooModel("bert", "transformers", _bert, _classify_batches),
        ZooModel("vit", "transformers", _vit, _image_batches),
        ZooModel("t5", "transformers", _t5, _seq2seq_batches),
    )
}


def model_output_loss(model, batch):
    """What a transformers user's training step computes: the model's own loss."""
    out = model(**batch)
    return out.loss, out.logits


def hf_trainer_class():
    """``fasttrain.Trainer`` with the usual transformers override of the loss hooks."""
    from fasttrain.trainer import Trainer

    class HFTrainer(Trainer):
        def calculate_train_batch_loss(self, batch):
            loss, logits = model_output_loss(self.model, batch)
            return {"loss": loss, "model_outputs": logits, "batch_size": batch["labels"].size(0)}

        def calculate_eval_batch_loss(self, batch):
            loss, logits = model_output_loss(self.model, batch)
            return {"loss": loss, "model_outputs": logits, "batch_size": batch["labels"].size(0)}

    return HFTrainer
