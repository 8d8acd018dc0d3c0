"""A tiny RoBERTa in the official Hugging Face file format, as roberta-base's repository has it:
config.json of a RobertaModel (2 layers, hidden 32, 2 heads, intermediate 64, one token type,
pad_token_id 1 and 2 + 64 positions: a record's positions start after the pad id, as fairseq
numbers them), model.safetensors of random weights drawn from a seed (with the pooler, as a
checkpoint has it) and a byte-level BPE tokenizer (``<s>`` 0, ``<pad>`` 1, ``</s>`` 2, ``<unk>``
3, ``<mask>`` 4) trained on a few words with the ``tokenizers`` library: vocab.json and
merges.txt as roberta-base ships them, and tokenizer.json and tokenizer_config.json as
transformers' RobertaTokenizer saves them. No sentence-transformers files: transformers' own
encoders are mean-pooled without normalisation. Kilobytes, written in a temporary folder;
tests/conftest.py's ``tiny_roberta_dir`` fixture makes one per session."""

from __future__ import annotations

import json
from pathlib import Path

import torch

SPECIAL = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]  # roberta-base's ids 0..4
WORDS = ("the of and a to in is you that it he was for on are as with his they at be this "
         "fortune cookie love wise fool time life day night").split()
BPE_VOCAB = 300  # 256 bytes, 5 special tokens and 39 merges
PAD = 1
TOKENS = 64  # a record's usable positions: max_position_embeddings - (PAD + 1)
DIMS = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
        "max_position_embeddings": TOKENS + PAD + 1, "type_vocab_size": 1}


def write_tiny_roberta(directory: Path, seed: int = 0) -> Path:
    """Writes the tiny RoBERTa into ``directory`` (made if missing) and returns it; the caller's
    random stream is left as it was."""
    from tokenizers import ByteLevelBPETokenizer

    from dpbench.problems.encoder_model import _transformers

    _transformers()
    from transformers import RobertaConfig, RobertaModel, RobertaTokenizer

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([" ".join(WORDS)] * 3 + WORDS, vocab_size=BPE_VOCAB, min_frequency=1,
                            special_tokens=SPECIAL, show_progress=False)
    bpe.save_model(str(directory))  # vocab.json, merges.txt
    vocab = json.loads((directory / "vocab.json").read_text())
    assert [vocab[t] for t in SPECIAL] == list(range(len(SPECIAL)))
    merges = [tuple(line.split(" ")) for line in (directory / "merges.txt").read_text().splitlines()[1:] if line]
    RobertaTokenizer(vocab=vocab, merges=merges).save_pretrained(directory)  # tokenizer.json, tokenizer_config.json
    config = RobertaConfig(vocab_size=len(vocab), pad_token_id=PAD, bos_token_id=0, eos_token_id=2, **DIMS)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = RobertaModel(config)
        with torch.no_grad():  # LayerNorms away from (1, 0); positions' rows distinct enough to matter
            for name, p in model.named_parameters():
                if "LayerNorm" in name:
                    p.add_(0.1 * torch.randn_like(p))
                elif name.endswith("position_embeddings.weight"):
                    p.normal_(0, 0.5)
    model.save_pretrained(directory, safe_serialization=True)
    return directory
