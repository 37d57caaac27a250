"""The documentation's links and citations resolve:

- every relative Markdown link in README.md, docs/, the model cards and scripts/research/README.md names a
  file or folder of the repository, and a `#anchor` names a heading of the page it points at;
- every measurement the docs or the code cite (`docs/measurements/NAME`, a glob pattern in code comments,
  or a dated file name in backticks in the docs) is a file in docs/measurements/;
- every file in docs/measurements/ is listed in its index, docs/measurements/README.md.
"""

from __future__ import annotations

import re
from fnmatch import fnmatch
from pathlib import Path

from tests import REPO

MEASUREMENTS = REPO / "docs" / "measurements"
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
CITED = re.compile(r"docs/measurements/([\w.*{},-]+)")
DATED = re.compile(r"`([\w.-]+-\d{4}-\d{2}-\d{2}[\w.-]*\.(?:json|md|png))`")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def pages() -> list[Path]:
    """The Markdown a reader follows links in (the measurement files themselves are records, not pages)."""
    found = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "models").glob("*/README.md"))]
    found += sorted((REPO / "scripts").rglob("README.md"))
    return [p for p in found if p.parent != MEASUREMENTS or p.name == "README.md"]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        if m := re.match(r"#{1,6} (.+)", line):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def dead_links(page: Path, root: Path = REPO) -> list[str]:
    """Each relative link of ``page`` that names no file, folder or heading, as 'page: target (why)',
    the page named relative to ``root``."""
    problems = []
    for m in LINK.finditer(FENCE.sub("", page.read_text())):
        target = m.group(1) or m.group(2)
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        where = (page.parent / path).resolve() if path else page
        if not where.exists():
            problems.append(f"{page.relative_to(root)}: {target} (no such file)")
        elif anchor and where.suffix == ".md" and anchor not in anchors(where):
            problems.append(f"{page.relative_to(root)}: {target} (no heading #{anchor} in {where.name})")
    return problems


def expand(pattern: str) -> list[str]:
    """a.{json,png} -> a.json, a.png"""
    m = re.search(r"\{([^}]*)\}", pattern)
    if not m:
        return [pattern]
    return [x for part in m.group(1).split(",") for x in expand(pattern[: m.start()] + part + pattern[m.end() :])]


def missing_measurements(text: str, markdown: bool) -> list[str]:
    """Cited measurement names (or glob patterns) that match no file of docs/measurements/."""
    files = [p.name for p in MEASUREMENTS.iterdir()]
    cited = [name.rstrip(".,") for name in CITED.findall(text)]
    if markdown:
        cited += DATED.findall(text)
    return sorted({c for name in cited for c in expand(name) if c and not any(fnmatch(f, c) for f in files)})


def test_every_relative_link_resolves() -> None:
    problems = [p for page in pages() for p in dead_links(page)]
    assert not problems, "dead links:\n" + "\n".join(problems)


def test_every_cited_measurement_exists() -> None:
    sources = [*pages(), *(p for top in ("ldlm", "export", "serve", "scripts", "tests") for p in sorted((REPO / top).rglob("*.py")))]
    sources += sorted((REPO / "scripts").rglob("*.sh"))
    sources = [s for s in sources if s != Path(__file__)]  # this file's own examples name missing files on purpose
    problems = [f"{s.relative_to(REPO)}: {name}" for s in sources for name in missing_measurements(s.read_text(), s.suffix == ".md")]
    assert not problems, "cited measurements missing from docs/measurements/:\n" + "\n".join(problems)


def test_every_measurement_is_indexed() -> None:
    index = (MEASUREMENTS / "README.md").read_text()
    unlisted = sorted(p.name for p in MEASUREMENTS.iterdir() if p.name != "README.md" and p.name not in index)
    assert not unlisted, f"files of docs/measurements/ not in its README.md: {unlisted}"


def test_the_checks_find_a_planted_dead_link_and_a_missing_measurement(tmp_path: Path) -> None:
    """The checks themselves, on a page whose answers are known."""
    (tmp_path / "there.md").write_text("# A title: with `code`\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md#a-title-with-code) [ok](there.md#twice-1) [web](https://example.com) [self](#top)\n"
        "# Top\n[gone](nowhere.md) [bad anchor](there.md#missing)\n```\n[in code](ignored.md)\n```\n"
    )
    problems = [p.split(": ", 1)[1] for p in dead_links(page, root=tmp_path)]
    assert problems == ["nowhere.md (no such file)", "there.md#missing (no heading #missing in there.md)"]
    assert missing_measurements("see docs/measurements/no-such-file-2026-01-01.json.", markdown=False) == ["no-such-file-2026-01-01.json"]
    assert missing_measurements("`also-missing-2026-01-01.png`", markdown=True) == ["also-missing-2026-01-01.png"]
    assert expand("a-1.{json,png}") == ["a-1.json", "a-1.png"]
