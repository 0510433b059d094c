"""Work that functional tests wait for and that needs nothing of the session: the hang scenarios
(each waits out a one-minute timeout with its ranks blocked) and the case tests' single-process
reference runs (a minute of one core in all). A test module declares such work with
`@started_with_the_session`; conftest.py starts what the collected tests use as soon as the
session is collected, in threads beside the case batch, and marks those tests `beside_cases`
(make test runs them with the batch). Run any other way (a test alone, a pytest-xdist worker),
the fixture does the work when first asked."""

import concurrent.futures
import tempfile
from typing import Callable

import pytest

# (module, fixture name) -> function(directory) -> the fixture's value
STARTERS: dict[tuple[str, str], Callable[[str], object]] = {}
STARTED: dict[tuple[str, str], concurrent.futures.Future] = {}
# the hang scenarios in one thread (they run theirs side by side), the reference runs one at a
# time in the other: beside the batch's eight processes, more would only share the same cores
_POOL = concurrent.futures.ThreadPoolExecutor(2)


def started_with_the_session(function: Callable[[str], object]):
    """`function(directory)` as a module fixture of its name, its work started with the
    session where the session runs a test that uses it."""
    key = (function.__module__, function.__name__)
    STARTERS[key] = function

    @pytest.fixture(scope="module", name=function.__name__)
    def fixture(tmp_path_factory):
        future = STARTED.get(key)
        if future is None:
            return function(str(tmp_path_factory.mktemp(function.__name__)))
        return future.result()

    fixture.__doc__ = function.__doc__
    return fixture


def uses(item: pytest.Item) -> list[tuple[str, str]]:
    """The started-with-the-session fixtures of a collected test."""
    module = getattr(getattr(item, "module", None), "__name__", None)
    names = getattr(item, "fixturenames", ())
    return [(module, name) for name in names if (module, name) in STARTERS]


def start(keys: list[tuple[str, str]]) -> None:
    """Start the work of `keys` in their order (the tests' collection order: the hang
    scenarios of test_faults.py first)."""
    for key in keys:
        if key not in STARTED:
            directory = tempfile.mkdtemp(prefix=f"{key[1]}_")
            STARTED[key] = _POOL.submit(STARTERS[key], directory)
