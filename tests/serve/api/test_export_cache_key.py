"""The export cache's key covers every way an export is asked for: the same checkpoint exported with or
without the decoder's logits, or with ``--quantize int8``, is another export, so a server never reuses an
entry made without the variants (or the logits) it serves."""

from __future__ import annotations

from pathlib import Path

from ldlm.files import sha256_file
from ldlm.serve.api.export_cache import export_key


def test_logits_and_quantize_each_make_another_key(tiny_checkpoint: Path) -> None:
    plain, weights = export_key(tiny_checkpoint, with_logits=True)
    assert weights == sha256_file(tiny_checkpoint / "model.safetensors")
    assert export_key(tiny_checkpoint, with_logits=True) == (plain, weights)  # the same export asked again: the same entry
    keys = {
        plain,
        export_key(tiny_checkpoint, with_logits=False)[0],
        export_key(tiny_checkpoint, with_logits=True, quantize="int8")[0],
        export_key(tiny_checkpoint, with_logits=False, quantize="int8")[0],
    }
    assert len(keys) == 4, keys
