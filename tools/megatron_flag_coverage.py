"""How many of Megatron-LM's GPT pretraining command lines our pretrain_gpt.py accepts.

The command lines are the MODEL_ARGS of Megatron-LM's GPT functional-test configs
(`tests/functional_tests/test_cases/gpt/*/model_config.yaml`, pretraining ones only) and the
flags of two example scripts, stored as flag/value lists in
`tools/data/megatron_gpt_command_lines.json` (paths replaced by placeholders).

    python tools/megatron_flag_coverage.py                  # report (markdown)
    python tools/megatron_flag_coverage.py --extract DIR    # refresh the list from a checkout
    python tools/megatron_flag_coverage.py --extract-flags DIR  # refresh the parser's flags
    python tools/megatron_flag_coverage.py --flag-table     # one docs row per Megatron flag

Besides the command lines, it reports every flag of Megatron-LM's pretraining parser (its
in-scope flags, stored in `tools/data/megatron_pretraining_flags.json` and read from a
checkout by tools/megatron_parser_flags.py) that our parser does not know.

    python tools/megatron_flag_coverage.py --moe [--extract DIR]

`--moe`: Megatron-LM's MoE and Mixtral functional-test configs instead
(`test_cases/moe/` and `test_cases/mixtral/`, pretraining ones only), stored in
`tools/data/megatron_moe_command_lines.json`. Each command line is validated with the world
size its layout needs, PP x lcm(TP x CP, ETP x EP).

Each command line is parsed by `build_parser()` and validated by `validate_args(...,
check_files=False)` with data parallel size 1. Outcomes: `accepted`; `not supported yet`
(parsed, then rejected naming a feature we do not have; every such flag is listed); `other
error` (parsed, then rejected for another reason); `parse error` (unknown flag or bad value).
"""

import argparse
import json
import os
import sys

from megatron.common.errors import run_tool
from megatron.studies.flag_coverage import (
    decode,
    encode,
    extract_functional_configs,
    extract_parser_flags,
    parser_flag_report,
    parser_flag_table,
    report,
)

TOOLS = os.path.dirname(os.path.abspath(__file__))
DATA_FILE = os.path.join(TOOLS, "data", "megatron_gpt_command_lines.json")
FLAGS_FILE = os.path.join(TOOLS, "data", "megatron_pretraining_flags.json")
MOE_DATA_FILE = os.path.join(TOOLS, "data", "megatron_moe_command_lines.json")
MOE_SOURCE = ("Megatron-LM (github.com/NVIDIA/Megatron-LM): MoE and Mixtral functional-test "
              "configs' MODEL_ARGS (MODE not inference/rl); flag names and values only, paths as "
              "placeholders")  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--extract", metavar="MEGATRON_DIR",
                        help="refresh the functional-test configs from a Megatron-LM checkout")  # fmt: skip
    parser.add_argument("--data", default=None)
    parser.add_argument("--moe", action="store_true",
                        help="Megatron-LM's MoE and Mixtral functional-test configs")  # fmt: skip
    parser.add_argument("--flags", default=FLAGS_FILE, help="Megatron's stored parser flags")
    parser.add_argument("--extract-flags", metavar="MEGATRON_DIR",
                        help="refresh the stored parser flags from a Megatron-LM checkout")  # fmt: skip
    parser.add_argument("--flag-table", action="store_true",
                        help="print one markdown row per Megatron flag, nothing else")  # fmt: skip
    options = parser.parse_args(argv)
    data = options.data or (MOE_DATA_FILE if options.moe else DATA_FILE)
    if options.moe:
        if options.extract:
            stored = {"source": MOE_SOURCE, **encode(
                extract_functional_configs(options.extract, ("moe", "mixtral")))}  # fmt: skip
            with open(data, "w") as handle:
                json.dump(stored, handle, separators=(",", ":"))
                handle.write("\n")
        with open(data) as handle:
            print(report(decode(json.load(handle)), examples=0))
        return 0
    with open(options.flags) as handle:
        stored_flags = json.load(handle)
    if options.extract_flags:
        script = os.path.join(TOOLS, "megatron_parser_flags.py")
        stored_flags["flags"] = extract_parser_flags(options.extract_flags, script)
        with open(options.flags, "w") as handle:
            json.dump(stored_flags, handle, separators=(",", ":"))
            handle.write("\n")
    if options.flag_table:
        print(parser_flag_table(stored_flags["flags"]))
        return 0
    with open(data) as handle:
        stored = json.load(handle)
    command_lines = decode(stored)
    if options.extract:
        examples = {k: v for k, v in command_lines.items() if k.startswith("examples/")}
        command_lines = {**extract_functional_configs(options.extract), **examples}
        stored.update(encode(command_lines))
        with open(data, "w") as handle:
            json.dump(stored, handle, separators=(",", ":"))
            handle.write("\n")
    print(report(command_lines))
    print()
    print(parser_flag_report(stored_flags["flags"]))
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
