"""Every promise the docs make that tests/tools/mutation_promises.py maps stays pinned: its quote is still in
its doc file (whitespace aside: the docs wrap lines anywhere), and the mutation that breaks it is still in
mutation_check's list. A promise edited out of the docs, or its entry removed, fails here at once."""

from __future__ import annotations

from pathlib import Path

from tests.tools.mutation_check import MUTATIONS
from tests.tools.mutation_promises import PROMISE_MUTATIONS, PROMISES

ROOT = Path(__file__).resolve().parents[2]


def flat(text: str) -> str:
    return " ".join(text.split())


def stale_promises(root: Path, promises: tuple[tuple[str, str, str], ...], ids: set[str]) -> list[str]:
    """Why each row of ``promises`` no longer pins its promise: a doc that is gone or not one of the docs,
    a quote no longer in it, or an entry id that is not in ``ids``."""
    problems = []
    for doc, quote, mutation_id in promises:
        path = root / doc
        if doc != "README.md" and not (doc.startswith("docs/") and doc.count("/") == 1 and doc.endswith(".md")):
            problems.append(f"{doc}: not README.md or a page of docs/")
        elif not path.is_file():
            problems.append(f"{doc}: no such file")
        elif flat(quote) not in flat(path.read_text()):
            problems.append(f"{doc}: no longer says {quote!r} (pinned by {mutation_id})")
        if mutation_id not in ids:
            problems.append(f"{doc}: {quote!r} is pinned by {mutation_id}, which is not in mutation_check's list")
    return problems


def test_every_promise_is_in_its_doc_and_pinned_by_an_entry_of_the_list() -> None:
    problems = stale_promises(ROOT, PROMISES, {m.id for m in MUTATIONS})
    assert not problems, "\n".join(problems)


def test_every_entry_written_for_a_promise_pins_one_and_is_in_the_list() -> None:
    written = [fields[0] for fields in PROMISE_MUTATIONS]
    pinned = {mutation_id for _, _, mutation_id in PROMISES}
    assert sorted(set(written) - pinned) == []
    assert [m.id for m in MUTATIONS if m.id in set(written)] == written  # appended once, in order


def test_a_promise_edited_out_or_an_entry_removed_is_named(tmp_path: Path) -> None:
    """The check itself: the quote is found across a line break, and is missed once the doc says otherwise."""
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "page.md"
    page.write_text("The server binds\n127.0.0.1 unless told otherwise.\n")
    row = ("docs/page.md", "binds 127.0.0.1 unless told", "bind-any")
    assert stale_promises(tmp_path, (row,), {"bind-any"}) == []
    assert stale_promises(tmp_path, (row,), set()) == [
        "docs/page.md: 'binds 127.0.0.1 unless told' is pinned by bind-any, which is not in mutation_check's list"
    ]
    page.write_text("The server binds 0.0.0.0.\n")
    assert stale_promises(tmp_path, (row,), {"bind-any"}) == [
        "docs/page.md: no longer says 'binds 127.0.0.1 unless told' (pinned by bind-any)"
    ]
    others = (("docs/measurements/README.md", "x", "bind-any"), ("docs/gone.md", "x", "bind-any"))
    assert stale_promises(tmp_path, others, {"bind-any"}) == [
        "docs/measurements/README.md: not README.md or a page of docs/",
        "docs/gone.md: no such file",
    ]
