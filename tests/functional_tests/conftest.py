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
    """The tests of the case batch are marked `cases`, those whose reference runs start with the
    session beside it (background.py) `beside_cases`: `make test` runs them together as a part
    of their own."""
    for item in items:
        if "case_results" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cases)
        if background.beside_cases(item):
            item.add_marker(pytest.mark.beside_cases)


def pytest_collection_finish(session):
    """Start the work that the collected tests wait for (background.py); each pytest-xdist
    worker collects every test of the session, and the first to claim a piece of work runs it
    for all."""
    if session.config.option.collectonly:
        return
    worker = getattr(session.config, "workerinput", None)
    if worker is not None:
        background.SHARED["directory"] = os.path.join(
            tempfile.gettempdir(), f"pytest-background-{worker['testrunuid']}"
        )
        os.makedirs(background.SHARED["directory"], exist_ok=True)
    background.start([key for item in session.items for key in background.uses(item)])


def pytest_sessionfinish(session):
    background.wait_for_started()
