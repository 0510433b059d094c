"""Megatron-style functional tests: run case directories and compare with golden values.

A case is a directory `test_cases/<model>/<case>/` holding `model_config.yaml`
(`NPROC`: processes, `ENV_VARS`, `MODEL_ARGS`: flag -> value, optionally `FORWARD_STEP`:
`module.function` replacing pretrain_gpt's forward_step) and `golden_values.json`
(`{"lm loss": {"start_step": 1, "end_step": N, "step_interval": 1, "values": {...}}}`).
Cases with the same process count and environment run in one launch (multi_run.py).

    python tests/functional_tests/run_cases.py [--cases NAME ...] [--output DIR] [--update-golden]
"""

import argparse
import concurrent.futures
import copy
import functools
import json
import os
import subprocess
import sys
import tempfile

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
CASES_DIR = os.path.join(HERE, "test_cases")


def discover_cases(cases_dir: str = CASES_DIR) -> dict[str, dict]:
    """Every case under `cases_dir`: its directory and its model_config.yaml (a fresh copy
    each call; the files are parsed once a process, which took 0.7 s a call)."""
    return copy.deepcopy(_parsed_cases(cases_dir))


@functools.cache
def _parsed_cases(cases_dir: str) -> dict[str, dict]:
    cases = {}
    for model in sorted(os.listdir(cases_dir)):
        for name in sorted(os.listdir(os.path.join(cases_dir, model))):
            directory = os.path.join(cases_dir, model, name)
            with open(os.path.join(directory, "model_config.yaml")) as file:
                config = yaml.load(file, Loader=_YAML_LOADER)
            cases[name] = {"directory": directory, **config}
    return cases


_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's, where built with it


def flags(model_args: dict, output: str) -> list[str]:
    """Flags from a case's MODEL_ARGS (a YAML list: several values); `{output}` in a value is the run's output directory,
    `{gpt2}` the GPT-2 BPE data that `prepare_gpt2_data` builds there."""
    result = []
    for flag, value in model_args.items():
        if value is True:
            result.append(flag)
        elif isinstance(value, list):  # a flag of several values (nargs)
            result.extend([flag, *(str(item) for item in value)])
        elif value is not False and value is not None:
            value = str(value).replace("{gpt2}", os.path.join(output, "gpt2"))
            result.extend([flag, value.replace("{output}", output)])
    return result


def prepare_gpt2_data(output: str) -> None:
    """A GPT-2 BPE vocab.json/merges.txt pair trained on a slice of the default corpus (the
    Python standard library's sources) and that slice tokenized with it, under output/gpt2;
    and the same BPE as a Megatron TikToken vocabulary (tiktoken.json, 1,023 ranks after
    TikTokenizer's 1,000 special ids) with the slice tokenized by it (stdlib_tiktoken_*); and
    under gpt2/fim the same BPE with --fim-data's four sentinels after <|endoftext|> (every other
    id the same) and the slice tokenized with it."""
    directory = os.path.join(output, "gpt2")
    fim = os.path.join(directory, "fim")
    if os.path.exists(os.path.join(fim, "stdlib_text_document.idx")):
        return
    corpus = os.path.join(directory, "stdlib.jsonl")
    steps = [
        ["build_corpus.py", "--output", corpus, "--max-docs", "12"],
        ["train_gpt2_bpe.py", "--input", corpus, "--output-dir", directory,
         "--vocab-size", "1024"],
        ["preprocess_data.py", "--input", corpus, "--json-keys", "text", "--output-prefix",
         os.path.join(directory, "stdlib"), "--tokenizer-type", "GPT2BPETokenizer",
         "--vocab-file", os.path.join(directory, "vocab.json"), "--merge-file",
         os.path.join(directory, "merges.txt"), "--append-eod", "--workers", "1"],
        ["build_tiktoken_vocab.py", "--vocab-file", os.path.join(directory, "vocab.json"),
         "--output", os.path.join(directory, "tiktoken.json")],
        ["preprocess_data.py", "--input", corpus, "--json-keys", "text", "--output-prefix",
         os.path.join(directory, "stdlib_tiktoken"), "--tokenizer-type", "TikTokenizer",
         "--tokenizer-model", os.path.join(directory, "tiktoken.json"), "--vocab-size", "2023",
         "--append-eod", "--workers", "1"],
        ["train_gpt2_bpe.py", "--input", corpus, "--output-dir", fim, "--vocab-size", "1024",
         "--special-tokens", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"],
        ["preprocess_data.py", "--input", corpus, "--json-keys", "text", "--output-prefix",
         os.path.join(fim, "stdlib"), "--tokenizer-type", "GPT2BPETokenizer",
         "--vocab-file", os.path.join(fim, "vocab.json"), "--merge-file",
         os.path.join(fim, "merges.txt"), "--append-eod", "--workers", "1"],
    ]  # fmt: skip
    for tool, *arguments in steps:
        command = [sys.executable, os.path.join(REPO, "tools", tool), *arguments]
        subprocess.run(command, cwd=REPO, check=True, capture_output=True, text=True)


def with_index_cache(args: list[str], output: str, launch: str = "") -> list[str]:
    """Mock-data cases of a launch share one --data-cache-path: megatron-core shuffles a whole
    epoch of its mock corpus for each split on every rank (most of a small case's CPU time), and
    with a cache rank 0 builds the indices once and every other rank and later case of the same
    data loads them, as on a cluster. The batches are the same either way. One cache per launch
    (`launch`): megatron-core writes its index files in place, so a launch running beside
    another could read a file the other is still writing."""
    if "--mock-data" in args and "--data-cache-path" not in args:
        return args + ["--data-cache-path", os.path.join(output, "index_cache", launch)]
    return args


# Cases per launch: each launch pays ~5 CPU-seconds of imports and start-up, each further case
# a CPU-second or two. A run leaves no threads behind (pretrain destroys its groups and collects
# them), so a launch can hold many; a failing case fails the rest of its launch with it.
CASES_PER_LAUNCH = 40
CONCURRENT_LAUNCHES = 2


def launches(groups: dict[tuple, list[str]], cases: dict):
    """(key, names) per launch: each group of equal NPROC/ENV_VARS, in chunks that never split
    the cases sharing a checkpoint directory (a --load reads what another case's --save wrote,
    in the order the cases are named), so that launches running at once share nothing."""
    for key, names in groups.items():
        chunk: list[str] = []
        for together in sharing_checkpoints(names, cases):
            if chunk and len(chunk) + len(together) > CASES_PER_LAUNCH:
                yield key, chunk
                chunk = []
            chunk += together
        if chunk:
            yield key, chunk


def sharing_checkpoints(names: list[str], cases: dict) -> list[list[str]]:
    """`names` in runs of cases linked by a --save/--load directory (in their order)."""
    first_user: dict[str, str] = {}  # directory -> the first case naming it
    parent = {name: name for name in names}

    def root(name: str) -> str:
        while parent[name] != name:
            name = parent[name]
        return name

    for name in names:
        arguments = cases[name]["MODEL_ARGS"]
        for flag in ("--save", "--load"):
            directory = arguments.get(flag) if isinstance(arguments, dict) else None
            if directory is not None:
                parent[root(name)] = root(first_user.setdefault(directory, name))
    runs: dict[str, list[str]] = {}
    for name in names:
        runs.setdefault(root(name), []).append(name)
    return list(runs.values())


# A case's start-up (process groups, model, data, optimizer) costs about what a few of its
# iterations do.
START_UP_ITERATIONS = 4


def estimated_cost(key: tuple, names: list[str], cases: dict) -> int:
    """A launch's relative cost: its processes times its cases' iterations and start-ups."""
    iterations = sum(int(cases[name]["MODEL_ARGS"].get("--train-iters") or 0) for name in names)
    return key[0] * (iterations + START_UP_ITERATIONS * len(names))


def run(case_names: list[str], output: str) -> dict[str, dict]:
    """Run the cases; return each case's summary.json (plus its log under 'log'). Two launches
    run at a time: a launch's ranks wait on each other about a quarter of the time on two
    cores, which the other launch fills."""
    cases = discover_cases()
    os.makedirs(output, exist_ok=True)
    if any("{gpt2}" in str(cases[name]["MODEL_ARGS"]) for name in case_names):
        prepare_gpt2_data(output)
    groups: dict[tuple, list[str]] = {}
    for name in case_names:
        case = cases[name]
        key = (case["NPROC"], json.dumps(case.get("ENV_VARS", {}), sort_keys=True))
        groups.setdefault(key, []).append(name)
    # the longest launches first, so that the short ones fill the last minutes beside each other
    # instead of one long launch running alone at the end
    ordered = sorted(launches(groups, cases), key=lambda launch: -estimated_cost(*launch, cases))
    with concurrent.futures.ThreadPoolExecutor(CONCURRENT_LAUNCHES) as pool:
        launched = [pool.submit(_launch, cases, key, names, output) for key, names in ordered]
        results = {}
        for future in launched:
            results.update(future.result())
    return results


def _launch(cases: dict, key: tuple, names: list[str], output: str) -> dict[str, dict]:
    """One launch of the cases `names` (equal NPROC and ENV_VARS): their summaries."""
    nproc, env_json = key
    spec = [
        {
            "name": name,
            "args": with_index_cache(flags(cases[name]["MODEL_ARGS"], output), output, names[0]),
            "metrics_dir": os.path.join(output, name),
            "forward_step": cases[name].get("FORWARD_STEP"),
        }
        for name in names
    ]
    spec_file = os.path.join(output, f"cases_{nproc}_{abs(hash(env_json))}_{names[0]}.json")
    json.dump(spec, open(spec_file, "w"))
    env = {**os.environ, **json.loads(env_json), "OMP_NUM_THREADS": "1"}
    # torch's elastic agent (torchrun's) in the launching process, the workers forked from it
    # after the imports (multi_run.py)
    command = [sys.executable, os.path.join(HERE, "multi_run.py"), f"--nproc-per-node={nproc}",
               spec_file]  # fmt: skip
    completed = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    log = completed.stdout + completed.stderr
    if completed.returncode != 0:
        log_file = spec_file.replace(".json", ".log")  # the whole log: the tail below is cut
        with open(log_file, "w") as file:
            file.write(log)
        raise RuntimeError(
            f"cases {names} failed (exit {completed.returncode}; whole log: {log_file}):\n"
            f"{_first_failure(log)}{log[-6000:]}"
        )
    results = {}
    for name in names:
        summary = json.load(open(os.path.join(output, name, "summary.json")))
        summary["log"] = log
        summary["metrics_dir"] = os.path.join(output, name)
        results[name] = summary
    return results


def _first_failure(log: str) -> str:
    """The case the launch was running when it failed and the first rank's traceback (the
    other ranks' broken-connection errors follow it and fill the log's tail)."""
    started = [line.removeprefix("=== case ") for line in log.splitlines()
               if line.startswith("=== case ")]  # fmt: skip
    case = started[-1] if started else "(before the first case)"
    first = ""
    if "Traceback (most recent call last)" in log:
        line_start = log.rfind("\n", 0, log.find("Traceback (most recent call last)")) + 1
        first = log[line_start : line_start + 4000]
    return f"running case: {case}\nfirst traceback:\n{first}\n...\n"


def cases_with_golden_values() -> list[str]:
    """Cases whose numbers are reproducible; reactive PACI cases have none (timing decides
    their order), and are checked against bounds instead."""
    return [
        name
        for name, case in discover_cases().items()
        if os.path.exists(os.path.join(case["directory"], "golden_values.json"))
    ]


def golden_losses(name: str) -> list[float]:
    path = os.path.join(discover_cases()[name]["directory"], "golden_values.json")
    values = json.load(open(path))["lm loss"]["values"]
    return [values[str(step)] for step in sorted(map(int, values))]


def relative_difference(a: list[float], b: list[float]) -> float:
    """The largest |a - b| / |b| over two equally long, non-empty loss curves."""
    assert len(a) == len(b) > 0
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def write_golden(name: str, losses: list[float]) -> None:
    path = os.path.join(discover_cases()[name]["directory"], "golden_values.json")
    golden = {
        "lm loss": {
            "start_step": 1,
            "end_step": len(losses),
            "step_interval": 1,
            "values": {str(step): loss for step, loss in enumerate(losses, start=1)},
        }
    }
    with open(path, "w") as handle:
        json.dump(golden, handle, indent=2)
        handle.write("\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=None)
    parser.add_argument("--output", default=None)
    parser.add_argument("--update-golden", action="store_true")
    options = parser.parse_args()
    names = options.cases or list(discover_cases())
    output = options.output or tempfile.mkdtemp(prefix="functional_")
    results = run(names, output)
    for name in names:
        losses = results[name]["loss"]
        if options.update_golden and not name.endswith("_reactive"):
            write_golden(name, losses)
        print(f"{name}: " + " ".join(f"{loss:.6f}" for loss in losses))
    return 0


if __name__ == "__main__":
    sys.exit(main())
