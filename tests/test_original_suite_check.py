"""The CI check of pytorch-accelerated's own suite (.ci/original_suite.py): it runs the procedure
docs/migrating.md gives and fails when the run disagrees with the page or passes too few tests.
Checked here on the real page and on pytest outputs written for the purpose (the run itself,
which downloads the sdist, is CI's)."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("original_suite", ROOT / ".ci" / "original_suite.py")
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)

DOCS = (ROOT / "docs" / "migrating.md").read_text()
MOCK_TESTS = [
    "test_trainer.py::test_max_steps_stops_training_correctly",
    "test_trainer.py::test_max_steps_overrides_num_epochs",
    "test_trainer.py::test_no_max_steps_completes_all_epochs",
]


def _output(passed, failed_ids, errors=(), extra=""):
    lines = ["....F..", "=========================== short test summary info ============================"]
    lines += [f"FAILED test/{test_id} - TypeError: 'Mock' object is not iterable" for test_id in failed_ids]
    lines += [f"ERROR test/{test_id} - RuntimeError" for test_id in errors]
    parts = [f"{len(failed_ids)} failed"] if failed_ids else []
    parts.append(f"{passed} passed")
    if errors:
        parts.append(f"{len(errors)} errors")
    lines.append(", ".join(parts) + f", 2 warnings{extra} in 7.24s")
    return "\n".join(lines) + "\n"


def test_the_page_gives_the_procedure_the_counts_and_the_table():
    procedure = check.documented_procedure(DOCS)
    assert "pip download --no-binary :all: --no-deps pytorch-accelerated==0.1.61" in procedure
    assert 'sys.modules["pytorch_accelerated"] = fasttrain' in procedure
    assert procedure.rstrip().endswith("python -m pytest -q -p no:cacheprovider test")
    assert check.documented_counts(DOCS) == (115, 118)
    assert check.documented_failures(DOCS) == set(MOCK_TESTS)


def test_a_run_as_documented_passes_the_check():
    assert check.problems(DOCS, _output(115, MOCK_TESTS)) == []


def test_the_results_are_read_from_the_closing_line_and_the_short_summary():
    counts, failed = check.run_results(_output(113, MOCK_TESTS[:2] + ["test_utils.py::test_x"], errors=["a.py::b"]))
    assert counts == {"failed": 3, "passed": 113, "error": 1}
    assert failed == set(MOCK_TESTS[:2]) | {"test_utils.py::test_x", "a.py::b"}


def test_fewer_passed_than_the_floor_fails():
    failing = MOCK_TESTS + ["test_trainer.py::test_run_config_per_process"]
    found = check.problems(DOCS, _output(114, failing))
    assert "114 of 118 passed, fewer than 115" in found
    assert any("not in migrating.md's table: ['test_trainer.py::test_run_config_per_process']" in p for p in found)


def test_a_documented_failure_that_passes_asks_for_the_page_to_be_updated():
    found = check.problems(DOCS, _output(116, MOCK_TESTS[:2]))
    assert found == [
        "116 of 118 passed; migrating.md says 115 of 118: update one of them",
        "in migrating.md's table but not failing: ['test_trainer.py::test_no_max_steps_completes_all_epochs']",
    ]


def test_a_run_that_never_reached_pytest_fails():
    output = "ERROR: Could not find a version that satisfies the requirement pytorch-accelerated==0.1.61\n"
    assert check.problems(DOCS, output) == [
        "the run printed no pytest summary line: the procedure did not get to run the tests"
    ]


def test_errors_count_towards_the_total():
    found = check.problems(DOCS, _output(114, MOCK_TESTS, errors=["test_utils.py::test_y"]))
    assert "114 of 118 passed, fewer than 115" in found


@pytest.mark.parametrize("broken,read", [
    (DOCS.replace("```bash", "```sh"), "documented_procedure"),
    (DOCS.replace("**115 of its 118 tests**", "115 of its 118 tests"), "documented_counts"),
    (DOCS.replace("| `test_trainer.py::", "| test_trainer.py::"), "documented_failures"),
], ids=["no-procedure", "no-counts", "no-table"])
def test_a_page_without_the_parts_the_check_reads_is_an_error(broken, read):
    with pytest.raises(ValueError, match="migrating.md: no "):
        getattr(check, read)(broken)
