"""Write the latents of tests/data/sampler_golden_cpu.json from the host-path code of commit 5f890ca.

Run it against that commit's ldlm, not this tree's (the point is a reference the device path did
not write)::

    mkdir /tmp/gold && git archive 5f890ca ldlm | tar -x -C /tmp/gold
    PYTHONPATH=/tmp/gold .venv/bin/python tests/data/make_sampler_golden.py

It checks that the old code still gives the stored token ids, then rewrites each case's latents
(float32, shortest round-trip decimal). The "scheduler" entry (token ids only) is left as it is.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

from ldlm.model.checkpoint import init_model
from ldlm.model.config import preset
from ldlm.model.tokenizer import TextTokenizer
from ldlm.pipeline import LDLMPipeline

GOLDEN_PATH = Path(__file__).parent / "sampler_golden_cpu.json"


def short_floats(latents: np.ndarray) -> list:
    """Nested lists of the shortest decimals that read back as exactly these float32 values."""
    if latents.ndim == 0:
        return float(np.format_float_positional(latents, unique=True))  # type: ignore[return-value]
    return [short_floats(row) for row in latents]


def main() -> None:
    import ldlm

    print(f"ldlm from {ldlm.__file__}", file=sys.stderr)
    golden = json.loads(GOLDEN_PATH.read_text())
    model = init_model(preset("tiny"), seed=0)
    pipe = LDLMPipeline(model, TextTokenizer.gpt2())
    for case, entry in golden.items():
        if case == "scheduler":
            continue
        seed, sampler, shape, steps = case.split("-")
        n, length = shape.split("x")
        latents = pipe.sample_latents(int(n), int(length), int(steps), int(seed), sampler)
        tokens = pipe.decode(latents).token_ids.tolist()
        if tokens != entry["tokens"]:
            raise SystemExit(f"{case}: this code's tokens differ from the stored ones; not the reference code?")
        entry.pop("latents_sha256", None)
        entry["latents"] = short_floats(latents.numpy().astype(np.float32))
    tmp = GOLDEN_PATH.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(golden) + "\n")
    tmp.replace(GOLDEN_PATH)


if __name__ == "__main__":
    main()
