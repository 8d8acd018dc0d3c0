"""A tiny BERT in the official Hugging Face file format, as all-MiniLM-L6-v2's package ships it:
config.json of a BertModel (2 layers, hidden 32, 2 heads, intermediate 64), model.safetensors of
random weights drawn from a seed (with the pooler, as a checkpoint has it), a WordPiece vocabulary
(vocab.txt, tokenizer.json, tokenizer_config.json) and sentence-transformers' modules.json and
1_Pooling/config.json (mean pooling, then Normalize). Kilobytes, written in a temporary folder;
tests/conftest.py's ``tiny_bert_dir`` fixture makes one per session."""

from __future__ import annotations

import json
from pathlib import Path

import torch

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ("the of and a to in is you that it he was for on are as with his they at be this "
         "fortune cookie love wise fool time life day night").split()
PIECES = ["##s", "##ing", "##ed", "##ly", ".", ",", "!", "?", "'"] + list("abcdefghijklmnopqrstuvwxyz") + \
    ["##" + c for c in "abcdefghijklmnopqrstuvwxyz"]
VOCAB = SPECIAL + WORDS + PIECES
DIMS = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
        "max_position_embeddings": 64, "type_vocab_size": 2}

MODULES = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
           {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
           {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
POOLING = {"word_embedding_dimension": 32, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
           "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}


def write_tiny_bert(directory: Path, seed: int = 0, sentence_transformers: bool = True) -> Path:
    """Writes the tiny BERT into ``directory`` (made if missing) and returns it; the caller's
    random stream is left as it was."""
    from dpbench.problems.encoder_model import _transformers

    transformers = _transformers()
    from transformers import BertConfig, BertModel, BertTokenizer

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = BertConfig(vocab_size=len(VOCAB), pad_token_id=0, **DIMS)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = BertModel(config)
        with torch.no_grad():  # LayerNorms away from (1, 0), so their gradients are not special
            for name, p in model.named_parameters():
                if "LayerNorm" in name:
                    p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(directory, safe_serialization=True)
    (directory / "vocab.txt").write_text("".join(f"{t}\n" for t in VOCAB))
    tokenizer = BertTokenizer(vocab={t: i for i, t in enumerate(VOCAB)}, do_lower_case=True)
    tokenizer.save_pretrained(directory)
    if sentence_transformers:
        (directory / "modules.json").write_text(json.dumps(MODULES, indent=2))
        (directory / "1_Pooling").mkdir(exist_ok=True)
        (directory / "1_Pooling" / "config.json").write_text(json.dumps(POOLING, indent=2))
    del transformers
    return directory
