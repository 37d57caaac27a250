"""tests/tools/mutation_score.py's arithmetic and its hold on the tree: every shard's modules and test files exist
(a renamed test file would otherwise stop a run hours in), the package-dir mapping of module names, and the
score as the docs define it (a timeout is a kill, an equivalent leaves the count, a mutant no test calls is a
survivor). Running mutmut takes hours and is not part of CI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.tools import mutation_score as ms

ROOT = Path(__file__).resolve().parents[2]


def test_every_shard_names_modules_and_tests_that_exist() -> None:
    modules = [module for shard in ms.SHARDS for module in shard.modules]
    assert len(modules) == len(set(modules)), "a module in two shards would be scored twice"
    assert len({shard.name for shard in ms.SHARDS}) == len(ms.SHARDS)
    for shard in ms.SHARDS:
        for module in shard.modules:
            assert (ROOT / module).is_file(), module
        assert all((ROOT / path).is_file() for path in ms.test_paths(shard)), shard.name


def test_module_names_follow_the_package_dir_mapping() -> None:
    assert ms.module_name("serve/api/routes/openai.py") == "ldlm.serve.api.routes.openai"
    assert ms.module_name("export/layernorm/verify.py") == "ldlm.export.layernorm.verify"
    assert ms.module_name("ldlm/sampling/slots.py") == "ldlm.sampling.slots"


def test_every_listed_equivalent_is_a_mutant_of_a_scored_module_with_a_reason() -> None:
    modules = {ms.module_name(module) for shard in ms.SHARDS for module in shard.modules}
    for name, why in ms.equivalents().items():
        assert name.rpartition(".")[0] in modules, f"{name}: not a mutant of a module of the score"
        assert len(why.split()) >= 4, f"{name}: say why it changes nothing observable"


def test_the_score_counts_timeouts_as_kills_and_leaves_equivalents_out() -> None:
    verdicts = {
        "ldlm.m.x_f__mutmut_1": ms.KILLED,
        "ldlm.m.x_f__mutmut_2": ms.KILLED,
        "ldlm.m.x_f__mutmut_3": ms.TIMEOUT,
        "ldlm.m.x_f__mutmut_4": ms.SURVIVED,
        "ldlm.m.x_f__mutmut_5": ms.NO_TESTS,
        "ldlm.m.x_f__mutmut_6": ms.SURVIVED,  # listed as equivalent
    }
    listed = {"ldlm.m.x_f__mutmut_6": "changes nothing a caller sees", "ldlm.m.x_f__mutmut_1": "listed, yet a test kills it"}
    facts = {"diffs": {"ldlm.m.x_f__mutmut_4": "-a\n+b"}, "left_out": {"ldlm/m.py": 3}}
    row = ms.module_report("ldlm/m.py", verdicts, facts, listed)
    assert row["score"] == round(3 / 5, 4)  # (2 killed + 1 timeout) of 5 scored: the equivalent is out, "no tests" is in
    assert (row["mutants"], row["equivalent"], row["message_mutants_left_out"]) == (6, 1, 3)
    assert [s["mutant"] for s in row["survivors"]] == ["ldlm.m.x_f__mutmut_4", "ldlm.m.x_f__mutmut_5"]
    assert row["survivors"][0]["diff"] == "-a\n+b"
    assert row["stale_equivalents"] == ["ldlm.m.x_f__mutmut_1"]
    assert ms.module_report("ldlm/m.py", {}, facts, {})["score"] is None  # nothing run is no score, not 0 or 100%


def test_a_rerun_of_named_mutants_keeps_the_other_verdicts(tmp_path: Path) -> None:
    """mutmut writes a file's results anew when it runs named mutants: the others' verdicts come back from before."""
    shard = ms.Shard("s", ("serve/m.py",), ())
    meta = tmp_path / "mutants" / "ldlm" / "serve" / "m.py.meta"
    meta.parent.mkdir(parents=True)
    before = {"serve/m.py": {"a": 1, "b": 0, "c": 36}}
    meta.write_text(json.dumps({"exit_code_by_key": {"a": None, "b": 1, "c": None}, "other": 7}))
    ms.keep_verdicts(tmp_path, shard, before)
    data = json.loads(meta.read_text())
    assert data == {"exit_code_by_key": {"a": 1, "b": 1, "c": 36}, "other": 7}  # b was run again: its new verdict stands


def test_a_rerun_takes_the_survivors_and_with_timeouts_those_that_ran_out_of_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Survived and reached by no test: run again; timed out: only when asked; killed and listed as equivalent: never."""
    names = {"k": ms.KILLED, "s": ms.SURVIVED, "t": ms.TIMEOUT, "n": ms.NO_TESTS, "e": ms.SURVIVED}
    verdicts = {f"ldlm.serve.m.x_f__mutmut_{n}": status for n, status in names.items()}
    monkeypatch.setattr(ms, "statuses", lambda work, module: verdicts if module == "serve/m.py" else {})
    monkeypatch.setattr(ms, "equivalents", lambda: {"ldlm.serve.m.x_f__mutmut_e": "why"})
    shard = ms.Shard("s", ("serve/m.py",), ())
    assert [name[-1] for name in ms.survivors(shard)] == ["n", "s"]
    assert [name[-1] for name in ms.survivors(shard, timeouts=True)] == ["n", "s", "t"]
    assert ms.parse_args(["--survivors", "--timeouts"]).timeouts
