"""A tokenizer file that cannot be read is named with what is wrong and how to fix it, in every command
that loads one (the tokenizer's own error is a bare ``Exception: expected value at line 1 column 1``)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ldlm.cli import main
from ldlm.model.tokenizer import TextTokenizer, TokenizerError

FIX = "replace it with the tokenizer.json of the checkpoint it came from, or point at the directory that holds the right one"


@pytest.fixture
def broken_checkpoint(tiny_checkpoint: Path, tmp_path: Path) -> Path:
    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint, broken)
    (broken / "tokenizer.json").write_text("<html>502 Bad Gateway</html>\n")  # a download that went wrong
    return broken


@pytest.mark.parametrize(
    "content, reason",
    [
        ("<html>502 Bad Gateway</html>\n", "not valid tokenizer JSON (expected value at line 1 column 1)"),
        ('{"version": "1.0"}', "not valid tokenizer JSON (Model missing. at line 1 column 18)"),
        ("", "not valid tokenizer JSON (EOF while parsing a value at line 1 column 0)"),
    ],
)
def test_the_file_and_the_problem_are_named(content: str, reason: str, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text(content)
    with pytest.raises(TokenizerError) as refused:
        TextTokenizer.from_directory(tmp_path)
    assert str(refused.value) == f"{tmp_path / 'tokenizer.json'} is {reason}; {FIX}"


def test_bpe_files_that_cannot_be_read_are_named(tmp_path: Path) -> None:
    (tmp_path / "vocab.json").write_text("[1, 2")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    with pytest.raises(TokenizerError, match=r"vocab\.json \+ .*merges\.txt are not a readable GPT-2 BPE vocabulary \(.*\); "):
        TextTokenizer.from_directory(tmp_path)


def test_a_tokenizer_without_end_of_text_is_named(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models

    Tokenizer(models.BPE(vocab={"a": 0}, merges=[])).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(TokenizerError, match=r"tokenizer\.json has no '<\|endoftext\|>' token; a GPT-2 BPE vocabulary is required"):
        TextTokenizer.from_directory(tmp_path)


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "{ckpt}", "--n", "1", "--length", "4", "--steps", "1", "--quiet"],
        ["reconstruct", "{ckpt}", "hello"],
        ["export", "{ckpt}", "{out}", "--graphs", "decoder", "--quiet"],
        ["serve", "{ckpt}", "--backend", "eager", "--port", "0"],
    ],
    ids=lambda argv: argv[0],
)
def test_every_command_names_the_broken_file(argv: list[str], broken_checkpoint: Path, tmp_path: Path, capsys) -> None:
    filled = [a.format(ckpt=broken_checkpoint, out=tmp_path / "onnx") for a in argv]
    assert main(filled) == 2
    err = capsys.readouterr().err
    expected = f"ldlm {argv[0]}: error: {broken_checkpoint / 'tokenizer.json'} is not valid tokenizer JSON (expected value at line 1 column 1); {FIX}"
    assert expected in err, err
    assert not (tmp_path / "onnx").exists()


def test_save_writes_what_the_library_writes_and_a_failed_write_is_an_os_error(tmp_path) -> None:
    """tokenizer.json's bytes are the tokenizers library's own (exports and their hashes unchanged), written by
    Python, so a failed write (a full disk, a missing folder) is an OSError naming the file, which the CLI and the
    export cache report as such, not the library's bare Exception."""
    from ldlm.model.tokenizer import TOKENIZER_FILE, TextTokenizer

    tokenizer = TextTokenizer.gpt2()
    tokenizer.save(tmp_path)
    tokenizer.tokenizer.save(str(tmp_path / "library.json"))
    assert (tmp_path / TOKENIZER_FILE).read_bytes() == (tmp_path / "library.json").read_bytes()
    with pytest.raises(OSError) as raised:
        tokenizer.save(tmp_path / "missing")
    assert str(tmp_path / "missing") in str(raised.value.filename)
