"""Print, as JSON, every flag of a Megatron-LM checkout's pretraining parser.

    python tools/megatron_parser_flags.py MEGATRON_DIR > flags.json

Builds Megatron-LM's own parser (`add_megatron_arguments` in its
`megatron/training/arguments.py`) and lists each option string with its argparse group and
how it parses: `[group, flag, kind]`, kind `switch` (no value), `value` (one) or `values`
(several). Run by tools/megatron_flag_coverage.py --extract-flags in a process of its own: the
checkout's `megatron` package replaces this project's there. Packages that the parser's
imports need but that do not install here (Triton kernels, NVIDIA's resiliency and logging
packages) are replaced by empty stand-ins; the parser itself does not use them.
"""

import argparse
import importlib.abc
import importlib.machinery
import json
import sys
import typing
from unittest import mock

ABSENT_PACKAGES = {"nvidia_resiliency_ext", "one_logger_utils", "nv_one_logger", "wandb", "nvtx",
                   "flashinfer", "mamba_ssm", "causal_conv1d", "tensorstore", "zarr",
                   "multistorageclient", "modelopt"}  # fmt: skip
TRITON_MODULES = {  # Megatron-LM modules that import Triton at import time
    "megatron.core.transformer.moe.ops.paged_stash",
    "megatron.core.ssm.ops.common.causal_conv1d_varlen",
    "megatron.core.ssm.ops.mamba2.batch_invariant_decode",
}


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ABSENT_PACKAGES or name in TRITON_MODULES:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = mock.MagicMock()
        module.__version__, module.__path__, module.__spec__ = "99.0.0", [], spec
        module.__name__ = spec.name
        return module

    def exec_module(self, module):
        pass


def kind_of(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "switch"
    return "value" if action.nargs in (None, "?") else "values"


def main(megatron_dir: str) -> None:
    import torch.utils.flop_counter  # noqa: F401  (before the stand-ins: torch probes Triton)

    typing.override = getattr(typing, "override", lambda function: function)  # Python 3.12's
    sys.path.insert(0, megatron_dir)
    sys.meta_path.insert(0, _StandIns())
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    flags = [[group.title, option, kind_of(action)]
             for group in parser._action_groups for action in group._group_actions
             for option in action.option_strings if option.startswith("--") and option != "--help"]  # fmt: skip
    json.dump(flags, sys.stdout)


if __name__ == "__main__":
    main(sys.argv[1])
