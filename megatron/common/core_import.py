"""megatron-core imported without two costs our runs never use: about 3 of its 8 s a process.

Importing megatron-core decorates its fused kernels with `torch.compile` (megatron/core/jit.py),
which imports TorchInductor's compiler at decoration time (~1.6 s), and its dynamic-inference
context imports Weights & Biases when installed (~1.5 s). Every rank of every launch pays both,
and a test suite starts hundreds of ranks. While megatron-core's package runs, `torch.compile`
is a lazy stand-in that compiles on the first call instead (the same compiled function, so the
same numbers), and `wandb` looks absent to it
(only its inference logging reads it; our own tracking imports wandb itself). Both are restored
as soon as megatron-core is imported, for every other importer.

Importing this module installs the hook (no torch import of its own: the simulator's packages
stay torch-free); the packages whose modules import megatron-core import it first. A process
that imports megatron-core before any of our packages gets the plain import.
"""

import functools
import importlib.abc
import importlib.machinery
import inspect
import sys

CORE = "megatron.core"


def _lazy_compile(real_compile):
    """`torch.compile` that compiles on the first call, with the same options."""

    def compile_later(model=None, **options):
        if model is None:  # @torch.compile(...)
            return lambda function: compile_later(function, **options)
        if not inspect.isfunction(model):  # a module or the like: compiled as asked
            return real_compile(model, **options)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kwargs):
            nonlocal compiled
            if compiled is None:
                compiled = real_compile(model, **options)
            return compiled(*args, **kwargs)

        return call

    return compile_later


class _LeanLoader(importlib.abc.Loader):
    """megatron-core's own loader, run with the two stand-ins in place."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        import torch

        real_compile, had_wandb = torch.compile, "wandb" in sys.modules
        torch.compile = _lazy_compile(real_compile)
        if not had_wandb:
            sys.modules["wandb"] = None  # `import wandb` raises ImportError
        try:
            self.loader.exec_module(module)
        finally:
            torch.compile = real_compile
            if not had_wandb and sys.modules.get("wandb", 0) is None:
                del sys.modules["wandb"]

    def __getattr__(self, name):  # resources and the like: the real loader's
        return getattr(self.loader, name)


class _LeanCoreFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != CORE:
            return None
        sys.meta_path.remove(self)  # once: megatron-core is imported a single time
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _LeanLoader(spec.loader)
        return spec


def install() -> None:
    if CORE not in sys.modules and not any(
        isinstance(finder, _LeanCoreFinder) for finder in sys.meta_path
    ):
        sys.meta_path.insert(0, _LeanCoreFinder())


install()
