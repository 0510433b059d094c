"""Work that functional tests wait for and that needs nothing of the session: the hang scenarios
(each waits out a one-minute timeout with a rank stopped) and the case tests' single-process
reference runs (a minute of one core in all). A test module declares such work with
`@started_with_the_session`; conftest.py starts what the collected tests use as soon as the
session is collected, in threads beside the tests. The references' tests are marked
`beside_cases`, and make test runs them with the case batch; the hang scenarios run with the
other functional tests, where pytest-xdist's first worker to collect starts them and a worker
whose test needs one waits for the result that the starting worker writes. Run on its own, a
test's fixture does the work when first asked."""

import concurrent.futures
import json
import os
import tempfile
import time
from typing import Callable

import pytest

# (module, fixture name) -> (function(directory) -> the fixture's value, beside the case batch)
STARTERS: dict[tuple[str, str], tuple[Callable[[str], object], bool]] = {}
STARTED: dict[tuple[str, str], concurrent.futures.Future] = {}
# Where the workers of one pytest-xdist session share the work (conftest.py sets it)
SHARED: dict[str, str] = {}
_POOL = concurrent.futures.ThreadPoolExecutor(2)
WAIT_S = 900  # for another worker's result


def started_with_the_session(function=None, *, beside_cases: bool = True):
    """`function(directory)` as a module fixture of its name, its work started with the
    session where the session runs a test that uses it; `beside_cases`: its tests run with the
    case batch. Under pytest-xdist the value travels as JSON."""

    def register(function):
        key = (function.__module__, function.__name__)
        STARTERS[key] = (function, beside_cases)

        @pytest.fixture(scope="module", name=function.__name__)
        def fixture(tmp_path_factory):
            if key in STARTED:
                return STARTED[key].result()
            if "directory" in SHARED and os.path.isdir(_claim(key)):
                return _wait_for(key)
            return function(str(tmp_path_factory.mktemp(function.__name__)))

        fixture.__doc__ = function.__doc__
        return fixture

    return register(function) if function is not None else register


def uses(item: pytest.Item) -> list[tuple[str, str]]:
    """The started-with-the-session fixtures of a collected test."""
    module = getattr(getattr(item, "module", None), "__name__", None)
    names = getattr(item, "fixturenames", ())
    return [(module, name) for name in names if (module, name) in STARTERS]


def beside_cases(item: pytest.Item) -> bool:
    return any(STARTERS[key][1] for key in uses(item))


def start(keys: list[tuple[str, str]]) -> None:
    """Start the work of `keys` in their order (the tests' collection order); under
    pytest-xdist only what no other worker has claimed."""
    for key in keys:
        if key in STARTED:
            continue
        if "directory" in SHARED:
            try:
                os.mkdir(_claim(key))
            except FileExistsError:
                continue  # another worker runs it
        directory = tempfile.mkdtemp(prefix=f"{key[1]}_")
        STARTED[key] = _POOL.submit(_run_and_share, key, directory)


def wait_for_started() -> None:
    """A worker that started work stays until it is done: another worker may wait for it."""
    for future in STARTED.values():
        future.exception()


def _run_and_share(key: tuple[str, str], directory: str):
    function, _ = STARTERS[key]
    try:
        value = function(directory)
    except BaseException as error:
        _share(key, {"error": f"{type(error).__name__}: {error}"})
        raise
    _share(key, {"value": value})
    return value


def _claim(key: tuple[str, str]) -> str:
    return os.path.join(SHARED["directory"], f"{key[0]}.{key[1]}")


def _share(key: tuple[str, str], record: dict) -> None:
    if "directory" not in SHARED:
        return
    path = os.path.join(_claim(key), "result.json")
    with open(path + ".tmp", "w") as file:
        json.dump(record, file, default=str)
    os.replace(path + ".tmp", path)  # whole or absent for the reader


def _wait_for(key: tuple[str, str]):
    path = os.path.join(_claim(key), "result.json")
    deadline = time.monotonic() + WAIT_S
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{key[1]}: no result from the worker that started it in {WAIT_S} s")
        time.sleep(0.5)
    record = json.load(open(path))
    if "error" in record:
        raise RuntimeError(f"{key[1]} failed in the worker that started it: {record['error']}")
    return record["value"]
