import os

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
    """The tests of the case batch are marked `cases`, those whose work starts with the session
    (background.py) `beside_cases`: `make test` runs them together as a part of their own."""
    for item in items:
        if "case_results" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cases)
        if background.uses(item):
            item.add_marker(pytest.mark.beside_cases)


def pytest_collection_finish(session):
    """Start the work that the collected tests wait for (background.py); a pytest-xdist worker
    does not know yet which tests it runs: there each fixture does its own when asked."""
    if hasattr(session.config, "workerinput") or session.config.option.collectonly:
        return
    background.start([key for item in session.items for key in background.uses(item)])
