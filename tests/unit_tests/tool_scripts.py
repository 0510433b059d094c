"""tools/*.py, which are scripts beside the packages and not modules of them, loaded as modules
for their unit tests."""

import importlib.util
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load(name: str):
    """tools/`name`.py as a module named `name`."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
