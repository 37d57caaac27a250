"""The reference corpus: public-domain prose from Debian's R data packages, as GPT-2 token ids.

- ``r-cran-janeaustenr``: Austen's six novels, one line of text per element;
- ``r-cran-tokenizers``: its ``mobydick`` data set, Melville's novel as one string with Project
  Gutenberg's header and licence around it (cut off here).

Nothing is downloaded: the packages are found installed (``/usr/lib/R/site-library``) or given as a
directory holding their ``.deb`` files or a tree unpacked from them (``apt-get download`` and
``dpkg-deb -x`` need no R). Each novel becomes one document of paragraphs, and documents are joined
by GPT-2's end-of-text token. The last ``held_out`` fraction of every document is kept apart, so
held-out text was never seen in training, not even as a neighbouring window.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ldlm.model.tokenizer import TextTokenizer
from ldlm.training.rdata import RDataError, read_lazy_load

PACKAGES: dict[str, tuple[str, ...]] = {  # R package -> its data sets used
    "janeaustenr": ("sensesensibility", "prideprejudice", "mansfieldpark", "emma", "northangerabbey", "persuasion"),
    "tokenizers": ("mobydick",),
}
SITE_LIBRARIES = (Path("/usr/lib/R/site-library"), Path("/usr/local/lib/R/site-library"), Path("/usr/lib/R/library"))
INSTALL_HINT = (
    "install the Debian packages r-cran-janeaustenr and r-cran-tokenizers (apt-get install), or, without R: "
    "`apt-get download r-cran-janeaustenr r-cran-tokenizers` and pass the directory holding the .deb files as --corpus"
)


class CorpusError(FileNotFoundError):
    """A corpus package that cannot be found or read; the message says what to install."""


@dataclass(frozen=True)
class Corpus:
    train: np.ndarray  # int64 token ids, documents joined by end-of-text
    held_out: np.ndarray
    documents: tuple[str, ...]  # the data sets' names, in order

    @property
    def vocabulary(self) -> np.ndarray:
        """Every token id that occurs anywhere in the corpus, sorted."""
        return np.unique(np.concatenate([self.train, self.held_out]))


def find_data_dir(package: str, corpus: Path | None) -> Path:
    """The ``data/`` directory of an R package: under ``corpus`` (an unpacked tree, or .deb files
    unpacked into ``corpus/.unpacked``), else in the system's R site libraries."""
    roots = []
    if corpus is not None:
        if not corpus.is_dir():
            raise CorpusError(f"--corpus {corpus} is not a directory; {INSTALL_HINT}")
        for deb in sorted(corpus.glob(f"r-cran-{package}_*.deb")):
            roots.append(_unpack_deb(deb, corpus / ".unpacked"))
        roots.append(corpus)
    roots += SITE_LIBRARIES
    for root in roots:
        for candidate in (root / package / "data", root / "usr/lib/R/site-library" / package / "data"):
            if (candidate / "Rdata.rdb").is_file():
                return candidate
    where = f"{corpus} or " if corpus is not None else ""
    raise CorpusError(f"R package {package!r} not found in {where}{', '.join(map(str, SITE_LIBRARIES))}; {INSTALL_HINT}")


def _unpack_deb(deb: Path, into: Path) -> Path:
    if (into / deb.stem / "usr").is_dir():
        return into / deb.stem
    if shutil.which("dpkg-deb") is None:
        raise CorpusError(f"{deb} needs dpkg-deb to unpack (or unpack it yourself with dpkg-deb -x); {INSTALL_HINT}")
    tmp = Path(tempfile.mkdtemp(prefix=f".{deb.stem}.", dir=into.parent if into.exists() else None))
    try:
        subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp)], check=True, capture_output=True)
        into.mkdir(parents=True, exist_ok=True)
        tmp.rename(into / deb.stem)  # whole or not at all
    except subprocess.CalledProcessError as error:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CorpusError(f"dpkg-deb -x {deb} failed: {error.stderr.decode(errors='replace').strip()}") from error
    return into / deb.stem


def paragraphs(lines: list[str]) -> str:
    """Hard-wrapped lines to paragraphs: lines joined by spaces, paragraphs by a blank line."""
    out, current = [], []
    for line in lines:
        line = (line or "").strip()
        if line:
            current.append(line)
        elif current:
            out.append(" ".join(current))
            current = []
    if current:
        out.append(" ".join(current))
    return "\n\n".join(out)


def strip_gutenberg(text: str) -> str:
    """The book between Project Gutenberg's START and END markers (the whole text if it has none)."""
    text = text.replace("\r\n", "\n").lstrip("\ufeff")
    start = re.search(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", text, re.M)
    end = re.search(r"^\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG", text, re.M)
    return text[start.end() if start else 0 : end.start() if end else len(text)]


def load_documents(corpus: Path | None = None) -> dict[str, str]:
    """Every data set of ``PACKAGES`` as one document of paragraphs, by name."""
    documents = {}
    for package, names in PACKAGES.items():
        data_dir = find_data_dir(package, corpus)
        try:
            data = read_lazy_load(data_dir)
        except RDataError as error:
            raise CorpusError(f"{data_dir}: {error}; reinstall the package ({INSTALL_HINT})") from error
        for name in names:
            value = data.get(name)
            if not isinstance(value, list) or not value or not all(isinstance(v, (str, type(None))) for v in value):
                raise CorpusError(f"{data_dir}: data set {name!r} is missing or not text; reinstall the package ({INSTALL_HINT})")
            lines = value if len(value) > 1 else strip_gutenberg(value[0] or "").split("\n")
            documents[name] = paragraphs(lines)
    return documents


def load_corpus(tokenizer: TextTokenizer, corpus: Path | None = None, held_out: float = 0.05) -> Corpus:
    if not 0.0 < held_out < 0.5:
        raise ValueError(f"held_out={held_out} is out of range: a fraction in (0, 0.5)")
    documents = load_documents(corpus)
    eos = tokenizer.eos_token_id
    train, kept = [], []
    for ids in tokenizer.encode(list(documents.values())):
        cut = int(len(ids) * (1 - held_out))
        train += ids[:cut] + [eos]
        kept += ids[cut:] + [eos]
    return Corpus(np.asarray(train, dtype=np.int64), np.asarray(kept, dtype=np.int64), tuple(documents))
