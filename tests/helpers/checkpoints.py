"""Tiny checkpoints in the formats roots come in (BERT, RoBERTa, MPNet; sentence-transformers pooling), words to tokenize."""

import json

import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import MPNetConfig, MPNetModel, RobertaConfig, RobertaModel


def st_folder(path, modes, normalize):
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "1_Pooling").mkdir(parents=True)
    (path / "modules.json").write_text(json.dumps(modules))
    keys = ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens",
            "pooling_mode_mean_sqrt_len_tokens")
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 4,
                                                                 **{k: k in modes for k in keys}}))
    return path


WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "in", "park", "stocks", "fell", "today", "##s"]


SPECIAL = ["<s>", "<pad>", "</s>", "<unk>", "[UNK]"]


TEXTS = ["the cat sat on the mat", "a dog ran", "stocks fell today in the park", "cats"]


def mpnet_style_tokenizer(folder):
    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS + ["<mask>"])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "sep_token": "</s>",
        "cls_token": "<s>", "unk_token": "[UNK]", "pad_token": "<pad>", "mask_token": "<mask>"}))
    return len(vocab)


def tiny_checkpoint(tmp_path, family: str):
    folder = tmp_path / family
    folder.mkdir()
    vocab = mpnet_style_tokenizer(folder)
    torch.manual_seed(0)
    kw = dict(vocab_size=vocab, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64,
              max_position_embeddings=66, pad_token_id=1, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = MPNetModel(MPNetConfig(**kw)) if family == "mpnet" else RobertaModel(RobertaConfig(**kw, type_vocab_size=1))
    with torch.no_grad():  # a random relative bias that matters (its init is zeros-ish)
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() == 2 else None
    model.eval().save_pretrained(folder, safe_serialization=True)
    return folder
