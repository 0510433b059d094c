"""The documentation's cheap checks (tools/check_docs.py --quick; `make docs-check` runs the
whole check): README.md's size, every page's size and kind, docs/index.md, every local link and
anchor, every repository path and module the pages name, every python snippet, and every
command of README.md and the guides in record mode, pretrain_gpt.py's command lines parsed and
validated by its own parser."""

import pytest
import tool_scripts


@pytest.fixture(scope="module")
def check_docs():
    return tool_scripts.load("check_docs")


@pytest.fixture(scope="module")
def pages(check_docs):
    return {path: check_docs.parse_page(path) for path in check_docs.all_pages()}


def test_sizes_kinds_index_links_and_names(check_docs, pages):
    report = check_docs.Report(verbose=False)
    check_docs.check_pages(pages, report)
    assert report.problems == []


def test_every_command_of_the_readme_and_the_guides(check_docs, pages):
    """Python snippets compile and name what exists; shell blocks run in record mode; every
    pretrain_gpt.py command line passes build_parser() and validate_args()."""
    report = check_docs.check(quick=True, verbose=False, pages=pages, in_process=True)
    assert report.problems == []


def test_a_stale_module_or_name_in_a_snippet_is_caught(check_docs):
    report = check_docs.Report(verbose=False)
    check_docs.check_python("from megatron.training import checkpoint_integrity", "a", report)
    check_docs.check_python(
        "from megatron.training.checkpointing import integrity\nintegrity.no_such_function()",
        "b",
        report,
    )
    check_docs.check_python("import megatron.training.no_such_module", "c", report)
    check_docs.check_python("print(open('tools/no_such_tool.py').read())", "d", report)
    check_docs.check_python("def broken(:\n    pass", "e", report)
    assert [problem.split(":")[0] for problem in report.problems] == ["a", "b", "c", "d", "e"]
    fine = check_docs.Report(verbose=False)
    check_docs.check_python(
        "from megatron.training.checkpointing import integrity\n"
        "from megatron.common.errors import UserError\n"
        "print(integrity.manifest_problem, UserError, open('tools/check_docs.py').name)",
        "f",
        fine,
    )
    assert fine.problems == []


def test_a_broken_link_anchor_and_a_missing_kind_are_caught(check_docs, pages):
    text = (
        "# A page\n\n[gone](no_such_page.md) [anchor](index.md#no-such-heading) `tools/gone.py`\n"
    )
    page = check_docs.Page("docs/a_page.md", text, prose=list(enumerate(text.split("\n"), 1)))
    report = check_docs.Report(verbose=False)
    check_docs.check_links(page, pages, report)
    check_docs.check_inline_names(page, report)
    assert len(report.problems) == 3
    assert check_docs.kind_of(page) is None
    assert check_docs.slug("3.8 A balanced layout, chosen from the `costs`") == (
        "38-a-balanced-layout-chosen-from-the-costs"
    )


def test_record_mode_records_instead_of_running(check_docs):
    block = check_docs.Block(
        "docs/a_page.md",
        1,
        "bash",
        "make demo no-such-target\n"
        "OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node 2 pretrain_gpt.py \\\n"
        "    --num-layers 2 | grep -v Warning\n"
        "FUNCTIONAL_CASES=no_such_case .venv/bin/python -m pytest -q tests/unit_tests\n",
    )
    report = check_docs.Report(verbose=False)
    calls = check_docs.record(block, report)
    assert [call.argv[0] for call in calls] == ["make", ".venv/bin/torchrun", ".venv/bin/python"]
    checks = check_docs.Checks()
    for call in calls:
        check_docs.check_call(call, checks, report)
    assert [(argv, world) for _, argv, world, _, _ in checks.pretrain] == [
        (["--num-layers", "2"], 2)
    ]
    assert report.problems == [
        "docs/a_page.md:1: make no-such-target: no such target in the Makefile",
        "docs/a_page.md:1: FUNCTIONAL_CASES names no_such_case: no such functional case",
    ]
