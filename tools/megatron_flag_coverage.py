"""How many of Megatron-LM's GPT pretraining command lines our pretrain_gpt.py accepts.

The command lines are the MODEL_ARGS of Megatron-LM's GPT functional-test configs
(`tests/functional_tests/test_cases/gpt/*/model_config.yaml`, pretraining ones only) and the
flags of two example scripts, stored as flag/value lists in
`tools/data/megatron_gpt_command_lines.json` (paths replaced by placeholders).

    python tools/megatron_flag_coverage.py                  # report (markdown)
    python tools/megatron_flag_coverage.py --extract DIR    # refresh the list from a checkout

Each command line is parsed by `build_parser()` and validated by `validate_args(...,
check_files=False)` with data parallel size 1. Outcomes: `accepted`; `not supported yet`
(parsed, then rejected naming a feature we do not have; every such flag is listed); `other
error` (parsed, then rejected for another reason); `parse error` (unknown flag or bad value).
"""

import argparse
import json
import os
import sys

from megatron.studies.flag_coverage import decode, encode, extract_functional_configs, report

DATA_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data",
                         "megatron_gpt_command_lines.json")  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--extract", metavar="MEGATRON_DIR",
                        help="refresh the functional-test configs from a Megatron-LM checkout")  # fmt: skip
    parser.add_argument("--data", default=DATA_FILE)
    options = parser.parse_args(argv)
    with open(options.data) as handle:
        stored = json.load(handle)
    command_lines = decode(stored)
    if options.extract:
        examples = {k: v for k, v in command_lines.items() if k.startswith("examples/")}
        command_lines = {**extract_functional_configs(options.extract), **examples}
        stored.update(encode(command_lines))
        with open(options.data, "w") as handle:
            json.dump(stored, handle, separators=(",", ":"))
            handle.write("\n")
    print(report(command_lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
