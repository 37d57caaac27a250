"""Write tests/data/reference-held-out-windows.json: windows of the reference checkpoint's held-out text
(the last 5% of every novel, which training never saw), as GPT-2 token ids, for the end-to-end test that
every window length keeps its last token. Needs the corpus packages' .deb files (see
scripts/train_reference.py)::

    .venv/bin/python tests/data/make_reference_held_out.py DIR_WITH_DEBS
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from ldlm.model.tokenizer import TextTokenizer
from ldlm.training.corpus import load_corpus

OUT = Path(__file__).parent / "reference-held-out-windows.json"
WINDOWS, LENGTH, SEED = 24, 128, 0


def main(corpus: Path) -> None:
    held_out = load_corpus(TextTokenizer.gpt2(), corpus).held_out
    starts = np.random.default_rng(SEED).integers(0, len(held_out) - LENGTH, WINDOWS)
    windows = [held_out[s : s + LENGTH].tolist() for s in starts]
    source = f"ldlm.training.corpus.load_corpus held-out ids, {WINDOWS} windows of {LENGTH} at seeded starts (seed {SEED})"
    OUT.write_text(json.dumps({"source": source, "windows": windows}) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
