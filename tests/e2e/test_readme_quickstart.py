"""The README's quickstart, as written: every shell and Python block of its "## Quickstart" section runs,
in order, on the shipped reference checkpoint, from a folder laid out like the repository's root (its
`models/` linked in, so `runs/` lands in a scratch folder and not in the checkout). The Python block runs
the export on ONNX Runtime and must write the texts that `ldlm generate` wrote in eager PyTorch with the
same seed: fp32 ONNX Runtime keeps every token of eager on this checkpoint."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

from tests import REPO

BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def quickstart_blocks(readme: str) -> list[tuple[str, str]]:
    """(language, code) of each fenced block in the README's Quickstart section, in order."""
    match = re.search(r"^## Quickstart\n(.*?)(?=^## )", readme, re.MULTILINE | re.DOTALL)
    assert match, "README.md has no '## Quickstart' section followed by another '## ' section"
    return [(lang, code) for lang, code in BLOCK.findall(match.group(1))]


def test_the_quickstart_blocks_are_found_in_a_sample() -> None:
    """The parser itself, on a README whose answer is known."""
    sample = "# x\n## Quickstart\n\n```bash\nldlm a\n```\ntext\n```python\nprint(1)\n```\n## Next\n```bash\nno\n```\n"
    assert quickstart_blocks(sample) == [("bash", "ldlm a\n"), ("python", "print(1)\n")]


def run(command: list[str], cwd: Path) -> str:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{command[:3]} failed with {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def test_the_readme_quickstart_runs_as_written(tmp_path: Path) -> None:
    blocks = quickstart_blocks((REPO / "README.md").read_text())
    assert [lang for lang, _ in blocks] == ["bash", "python"], "the quickstart is one shell block, then one Python block"
    (tmp_path / "models").symlink_to(REPO / "models", target_is_directory=True)
    shell = run(["bash", "-euo", "pipefail", "-c", blocks[0][1]], tmp_path)
    python = run([sys.executable, "-c", blocks[1][1]], tmp_path)

    # `ldlm generate` prints "[i] 'text'" per sample; the Python block prints the list of texts
    eager = [ast.literal_eval(line.split("] ", 1)[1]) for line in shell.splitlines() if re.match(r"\[\d+\] ", line)]
    onnx = ast.literal_eval(python.strip().splitlines()[-1])
    assert len(eager) == 2 and all(len(text.split()) >= 10 for text in eager), shell
    assert onnx == eager, "ONNX Runtime's texts differ from eager PyTorch's with the same seed"
    assert (tmp_path / "runs" / "onnx" / "manifest.json").is_file()
