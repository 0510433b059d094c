import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import run_cases  # noqa: E402


@pytest.fixture(scope="session")
def case_results(tmp_path_factory):
    """Every functional case, run once per session (grouped into one launch per world size)."""
    output = tmp_path_factory.mktemp("functional")
    return run_cases.run(list(run_cases.discover_cases()), str(output))
