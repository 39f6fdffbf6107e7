#!/usr/bin/env python3
"""Train the byte-level BPE tokenizer for the bundled Mixtral model.

Reads the *training* split written by ``build_corpus.py`` (``data/corpus/
train.jsonl``; validation/test text is never seen) and trains a byte-level BPE
with the Hugging Face ``tokenizers`` library:

* ByteLevel pre-tokenizer (no prefix space) + ByteLevel decoder, so decoding
  returns the original text, spaces and newlines included;
* special tokens ``<unk>`` = 0, ``<s>`` = 1 (BOS), ``</s>`` = 2 (EOS); ``<unk>``
  is never produced (byte-level alphabet covers every input);
* post-processor prepends ``<s>`` when ``add_special_tokens=True`` (the
  ``tokenizers`` default), like Llama/Mistral tokenizers.

Writes ``tokenizer.json`` and ``tokenizer_config.json`` to ``--out``.

Usage::

    python data/scripts/train_tokenizer.py --vocab-size 8192 --out data/model
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

DATA_DIR = Path(__file__).resolve().parent.parent
SPECIALS = ["<unk>", "<s>", "</s>"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--train", type=Path, default=DATA_DIR / "corpus" / "train.jsonl")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--min-frequency", type=int, default=2)
    ap.add_argument("--out", type=Path, default=DATA_DIR / "model")
    args = ap.parse_args()

    texts = [json.loads(line)["text"] for line in args.train.open(encoding="utf-8")]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=args.vocab_size,
        min_frequency=args.min_frequency,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    assert [tok.token_to_id(t) for t in SPECIALS] == [0, 1, 2]
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    args.out.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
    }
    (args.out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    n_chars = sum(len(t) for t in texts)
    n_tok = sum(len(e.ids) for e in tok.encode_batch(texts, add_special_tokens=False))
    sample = "It is a truth universally acknowledged,\nTo be, or not to be:  that is the question."
    enc = tok.encode(sample)
    assert tok.decode(enc.ids, skip_special_tokens=True) == sample
    print(f"vocab {tok.get_vocab_size()}  train chars {n_chars}  tokens {n_tok}  "
          f"chars/token {n_chars / n_tok:.3f}")
    print(enc.tokens)


if __name__ == "__main__":
    main()
