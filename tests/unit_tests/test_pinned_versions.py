"""The installed packages are the ones constraints.txt pins, and setup.py's ranges admit them."""

import ast
import importlib.metadata
import os
import sysconfig

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROJECT = "megatron-paci"


def pinned() -> dict[str, Version]:
    pins = {}
    for line in open(os.path.join(ROOT, "constraints.txt")):
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[canonicalize_name(name)] = Version(version)
    return pins


def installed() -> dict[str, Version]:
    """The environment's packages: its site-packages only (setuptools puts the packages it
    vendors on sys.path once imported, and those are not installed ones)."""
    site = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    found = {}
    for dist in importlib.metadata.distributions(path=site):
        found[canonicalize_name(dist.metadata["Name"])] = Version(dist.version)
    return found


def public(version: Version) -> Version:
    return Version(version.public)  # torch's CPU wheel is 2.13.0+cpu: the pin is 2.13.0


def setup_requirements() -> list[Requirement]:
    """install_requires and the dev extra, read from setup.py without running it."""
    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and n.keywords)
    keywords = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in (
        "install_requires", "extras_require")}  # fmt: skip
    return [
        Requirement(r) for r in keywords["install_requires"] + keywords["extras_require"]["dev"]
    ]


@pytest.mark.parametrize("name", sorted(pinned()))
def test_installed_version_is_the_pinned_one(name):
    version = installed().get(name)
    assert version is not None, f"{name} is pinned in constraints.txt but not installed"
    assert public(version) == pinned()[name], (
        f"{name} {version} is installed, constraints.txt pins {pinned()[name]}: "
        f"run `make venv` again, or update the pin (README.md, Dependencies)"
    )


def test_every_installed_package_is_pinned():
    unpinned = sorted(set(installed()) - set(pinned()) - {canonicalize_name(PROJECT)})
    assert not unpinned, f"installed but not pinned in constraints.txt: {', '.join(unpinned)}"


def test_setup_ranges_admit_the_pins():
    pins = pinned()
    for requirement in setup_requirements():
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{name} is required by setup.py but not pinned in constraints.txt"
        assert requirement.specifier.contains(
            pins[name], prereleases=True
        ), f"setup.py asks for {requirement}, constraints.txt pins {name}=={pins[name]}"
