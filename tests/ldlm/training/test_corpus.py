"""The reference corpus: packages found (or named missing, with what to install), texts reflowed, held-out text kept apart."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from ldlm.model.tokenizer import TextTokenizer
from ldlm.training.corpus import (
    PACKAGES,
    SITE_LIBRARIES,
    CorpusError,
    find_data_dir,
    load_corpus,
    load_documents,
    paragraphs,
    strip_gutenberg,
)
from tests.ldlm.training.test_rdata import strsxp, write_package

EMMA = ["EMMA", "", "Emma Woodhouse, handsome, clever, and rich,", "with a comfortable home.", "", "", "She was the youngest."]


def fake_packages(root: Path, damaged: str | None = None) -> Path:
    """Both packages' data, in the tree `dpkg-deb -x` makes: six short novels and a Gutenberg-wrapped Moby Dick."""
    library = root / "usr/lib/R/site-library"
    write_package(library / "janeaustenr" / "data", {name: strsxp([name.upper(), "", *EMMA[2:]]) for name in PACKAGES["janeaustenr"]})
    moby = "\ufeffThe Project Gutenberg EBook of Moby Dick\r\n*** START OF THIS PROJECT GUTENBERG EBOOK MOBY DICK ***\r\n\r\nCall me\r\nIshmael.\r\n\r\n*** END OF THIS PROJECT GUTENBERG EBOOK ***\r\nlicence text"
    write_package(library / "tokenizers" / "data", {"mobydick": strsxp([moby]) if damaged != "mobydick" else strsxp([])})
    return root


def test_paragraphs_and_gutenberg_markers() -> None:
    assert paragraphs(EMMA) == "EMMA\n\nEmma Woodhouse, handsome, clever, and rich, with a comfortable home.\n\nShe was the youngest."
    assert (
        strip_gutenberg("head\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\nbook\n*** END OF THE PROJECT GUTENBERG EBOOK X ***\nlicence")
        == "\nbook\n"
    )
    assert strip_gutenberg("no markers") == "no markers"


def test_load_corpus_keeps_the_end_of_every_document_apart(tmp_path: Path, tokenizer: TextTokenizer) -> None:
    root = fake_packages(tmp_path)
    documents = load_documents(root)
    body = "Emma Woodhouse, handsome, clever, and rich, with a comfortable home.\n\nShe was the youngest."
    assert documents == {**{name: f"{name.upper()}\n\n{body}" for name in PACKAGES["janeaustenr"]}, "mobydick": "Call me Ishmael."}
    corpus = load_corpus(tokenizer, root, held_out=0.25)
    assert corpus.documents == tuple(documents)
    eos, train, kept = tokenizer.eos_token_id, [], []
    for text in documents.values():  # the last quarter of every document, each part closed by end-of-text
        ids = tokenizer.encode([text])[0]
        train += ids[: int(len(ids) * 0.75)] + [eos]
        kept += ids[int(len(ids) * 0.75) :] + [eos]
    assert corpus.train.tolist() == train and corpus.held_out.tolist() == kept
    assert tokenizer.tokenizer.decode(corpus.held_out.tolist()).count("youngest.") == 6
    assert corpus.vocabulary.tolist() == sorted(set(train) | set(kept))


def test_a_missing_package_says_what_to_install(tmp_path: Path) -> None:
    if any((root / "janeaustenr").is_dir() for root in SITE_LIBRARIES):
        pytest.skip("r-cran-janeaustenr is installed on this machine: its absence cannot be shown")
    with pytest.raises(
        CorpusError, match=r"R package 'janeaustenr' not found in .*; install the Debian packages r-cran-janeaustenr and r-cran-tokenizers"
    ):
        find_data_dir("janeaustenr", tmp_path)
    with pytest.raises(CorpusError, match="apt-get download r-cran-janeaustenr r-cran-tokenizers"):
        find_data_dir("janeaustenr", None)
    with pytest.raises(CorpusError, match=f"--corpus {tmp_path / 'nowhere'} is not a directory"):
        find_data_dir("janeaustenr", tmp_path / "nowhere")


def test_a_damaged_data_set_is_named(tmp_path: Path, tokenizer: TextTokenizer) -> None:
    with pytest.raises(CorpusError, match="data set 'mobydick' is missing or not text; reinstall the package"):
        load_corpus(tokenizer, fake_packages(tmp_path, damaged="mobydick"))


@pytest.mark.skipif(
    shutil.which("dpkg-deb") is None, reason="dpkg-deb is not installed: unpacking a .deb given as --corpus was not exercised"
)
def test_deb_files_are_unpacked_once(tmp_path: Path, tokenizer: TextTokenizer) -> None:
    tree = fake_packages(tmp_path / "tree")
    debs = tmp_path / "debs"
    debs.mkdir()
    for package in PACKAGES:
        root = tmp_path / f"pkg-{package}"
        (root / "DEBIAN").mkdir(parents=True)
        (root / "DEBIAN" / "control").write_text(
            f"Package: r-cran-{package}\nVersion: 1.0\nArchitecture: all\nMaintainer: x <x@x>\nDescription: test\n"
        )
        shutil.copytree(tree / "usr/lib/R/site-library" / package, root / "usr/lib/R/site-library" / package)
        subprocess.run(
            ["dpkg-deb", "--build", "--root-owner-group", str(root), str(debs / f"r-cran-{package}_1.0_all.deb")],
            check=True,
            capture_output=True,
        )
    first = load_corpus(tokenizer, debs)
    assert sorted(p.name for p in (debs / ".unpacked").iterdir()) == ["r-cran-janeaustenr_1.0_all", "r-cran-tokenizers_1.0_all"]
    assert np.array_equal(first.train, load_corpus(tokenizer, debs).train)


def real_corpus() -> Path | None:
    given = os.environ.get("LDLM_CORPUS")
    if given:
        return Path(given)
    return None if not any((root / "janeaustenr").is_dir() for root in SITE_LIBRARIES) else Path("/nonexistent-use-site-library")


@pytest.mark.skipif(
    real_corpus() is None, reason="neither r-cran-janeaustenr is installed nor LDLM_CORPUS set: the real texts were not read"
)
def test_the_real_corpus_has_the_documented_size(tokenizer: TextTokenizer) -> None:
    corpus_dir = real_corpus()
    corpus = load_corpus(tokenizer, corpus_dir if corpus_dir and corpus_dir.is_dir() else None)
    assert 1.1e6 < len(corpus.train) + len(corpus.held_out) < 1.3e6  # 1.2M GPT-2 tokens, 20.4k distinct ids
    assert 20_000 < len(corpus.vocabulary) < 21_000
