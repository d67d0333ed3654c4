"""Byte-level BPE tokenizer trained on the corpus, with end-of-text and mask tokens."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from failfast.errors import FailfastError
from failfast.model import Tokenizer
from failfast.train.corpus import read_text

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"


def train_tokenizer(files: list[Path], vocab_size: int = 8192) -> Tokenizer:
    tok = _HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN, MASK_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator((read_text(f) for f in files), trainer=trainer)
    return Tokenizer(tok)


def special_ids(tokenizer: Tokenizer) -> tuple[int, int]:
    """(eos id, mask id); refuse a tokenizer that lacks either."""
    eos, mask = tokenizer.token_id(EOS_TOKEN), tokenizer.token_id(MASK_TOKEN)
    if eos is None or mask is None:
        missing = [name for name, i in ((EOS_TOKEN, eos), (MASK_TOKEN, mask)) if i is None]
        raise FailfastError(f"tokenizer lacks special tokens: {', '.join(missing)}")
    return eos, mask


def load_tokenizer(path: Path) -> Tokenizer:
    return Tokenizer.from_file(path)
