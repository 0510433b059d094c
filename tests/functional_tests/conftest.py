import pytest
import run_cases  # beside this file; pyproject.toml puts this directory on pytest's pythonpath


@pytest.fixture(scope="session")
def case_results(tmp_path_factory):
    """Every functional case, run once per session (grouped into one launch per world size)."""
    output = tmp_path_factory.mktemp("functional")
    return run_cases.run(list(run_cases.discover_cases()), str(output))
