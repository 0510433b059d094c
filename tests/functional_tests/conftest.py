import os
import tempfile

import background  # beside this file
import pytest
import run_cases  # beside this file; pyproject.toml puts this directory on pytest's pythonpath

# Cases that log to Weights & Biases (--wandb-project) write their run files and never go online.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture(scope="session")
def case_results(tmp_path_factory):
    """Every functional case, run once per session (grouped into one launch per world size).
    FUNCTIONAL_CASES=a,b,... runs only those (for a targeted run of one test file)."""
    output = tmp_path_factory.mktemp("functional")
    only = [name for name in os.environ.get("FUNCTIONAL_CASES", "").split(",") if name]
    return run_cases.run(only or list(run_cases.discover_cases()), str(output))


def pytest_collection_modifyitems(config, items):
    """The tests of the case batch are marked `cases`: `make test` runs them as a part of
    their own."""
    for item in items:
        if "case_results" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cases)


def pytest_collection_finish(session):
    """Start the waiting scenarios of the collected tests (background.py); a pytest-xdist
    worker does not know yet which tests it runs: there the fixture starts them."""
    if hasattr(session.config, "workerinput"):
        return
    if any("frozen_runs" in getattr(item, "fixturenames", ()) for item in session.items):
        from test_faults import start_frozen_runs

        directory = tempfile.mkdtemp(prefix="frozen")
        background.STARTED["frozen_runs"] = start_frozen_runs(background.POOL, directory)
