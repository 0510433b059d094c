"""Check the documentation: README.md and every page under docs/.

    python tools/check_docs.py            # everything (`make docs-check`)
    python tools/check_docs.py --quick    # the static part (tests/unit_tests/test_docs.py)

Static part, on every page:
  * README.md is at most 15,000 bytes; no hand-written docs page is over 30,000 bytes;
  * every docs page names its kind on its first line (`*Guide*: `, `*Reference*: ` or
    `*Report*: `), and docs/index.md links every page under the heading of its kind;
  * every link to a local file or anchor resolves (GitHub's heading anchors);
  * every repository path (`megatron/...`, `tools/...`, ...) and every `megatron.` module name
    in inline code exists, and so does every name a python snippet imports from them.

Shell blocks (bash, sh, console) of README.md, the guides and the reference pages (a report's
commands are the record of what was measured, kept as they ran) are executed in record mode: bash
runs the block as written, from the repository root, with `python`, `torchrun`, `make`,
`.venv/bin/*`, the example scripts' own launches and the cluster commands replaced by shell
functions that record their command line instead of running it (example scripts themselves
run, so their launches are recorded with the script's flags). Every recorded command is then
checked: `pretrain_gpt.py` command lines are parsed by the project's own parser and validated
(`megatron.training.arguments.build_parser`, `validate_args` at the launch's world size, the
data files included); python snippets (`python -c`, ```python blocks) compile and name only
modules and names that exist; `make` targets exist; `pytest` paths and functional case names
exist; scripts and tools exist; `python` and `torchrun` are the venv's (`.venv/bin/`), and no
block without a language holds a command. The full check also parses each tool's command line with the
tool's own argument parser (stopping right after parsing), collects the pytest commands
(`--collect-only`), executes the ```python blocks, and runs for real the blocks marked

    <!-- docs-check: run VAR=value ... -->

with those variables set (a page shows them as `${VAR:-default}`: the block runs shortened).
A block that cannot run here is marked, with the reason, and reported as skipped:

    <!-- docs-check: skip (needs 8 GPUs) -->
"""

import argparse
import ast
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README_LIMIT = 15_000
PAGE_LIMIT = 30_000
KINDS = {"Guide": "Guides", "Reference": "Reference", "Report": "Reports"}
KIND_LINE = re.compile(r"^\*(Guide|Reference|Report)\*: \S")
# Pages a program writes or fills: exempt from the size limit, or (rewritten whole by their
# generator) from the kind line; docs/index.md still lists them under their kind.
GENERATED_SIZE = {"docs/megatron_flags.md": "one row per Megatron flag, from "
                  "tools/megatron_flag_coverage.py --flag-table"}  # fmt: skip
GENERATED_WHOLE = {"docs/results/README.md": ("Report", "rewritten by tools/replicate.py report")}
COMMAND_LINE = re.compile(r"^\s*(?:[A-Z_]+=\S* )*(?:\.venv/bin/|torchrun |python3? |make |bash )")
SHELL_LANGS = {"bash", "sh", "shell", "console"}
DIRECTIVE = re.compile(r"^\s*<!--\s*docs-check:\s*(skip|run)\b(.*?)-->\s*$")
FENCE = re.compile(r"^(\s*)(```|~~~)\s*([\w+-]*)\s*$")
REPO_PATH = re.compile(r"(?<![\w./-])((?:megatron|tools|examples|tests|docs)/[\w./*-]*[\w/*])")
# Paths named in the docs that are not (yet) in a fresh clone, and why.
NOT_IN_A_CLONE = {
    "examples/gpt3/train_gpt3_175b_distributed.sh": "Megatron-LM's example script",
    "examples/llama/train_llama3_8b_h100_fp8.sh": "Megatron-LM's example script",
    "docs/calibration/gpu_gpt2_medium.json": "what tools/gpu_check.sh writes on a GPU",
    "docs/calibration/gpu_gpt2_medium_projection.md": "what tools/gpu_check.sh writes on a GPU",
}
MODULE_NAME = re.compile(r"(?<![\w./-])(megatron(?:\.\w+)+)")
RECORDED = ("python", "python3", "torchrun", "make", "pip", "pip3", "git", "sbatch", "srun",
            "salloc", "scontrol", "nvidia-smi", "tensorboard", "pytest", "curl", "wget")  # fmt: skip
VENV_TOOLS = ("python", "python3", "torchrun", "pip", "pip3", "tensorboard", "pytest")
CLUSTER = {"sbatch", "srun", "salloc", "scontrol", "nvidia-smi", "git", "pip", "pip3", "curl",
           "wget"}  # fmt: skip
# Flags of pretrain_gpt.py that name input files (their absence is a user's mistake).
INPUT_FILE_FLAGS = {"--tokenizer-model", "--vocab-file", "--merge-file", "--data-args-path",
                    "--per-split-data-args-path", "--calibration"}  # fmt: skip
DATA_PREFIX_FLAGS = {"--data-path", "--train-data-path", "--valid-data-path", "--test-data-path"}
# What the Makefile's data targets build: a block that runs `make TARGET` before a launch may
# name these files in a fresh clone (the quick check then validates that launch without its
# data files; `make docs-check` builds them first).
MAKE_OUTPUTS = {"data": "data/", "data-gpt2": "data/", "data-small": "runs/data_v1k/"}
# Tools that hand what follows `--` to pretrain_gpt.py's parser: the world size comes from
# torchrun or from the tool's own flag.
PRETRAIN_PASSTHROUGH = {"tools/memory_probe.py": None, "tools/soak_test.py": "--nproc"}


@dataclass
class Block:
    page: str
    line: int
    lang: str
    text: str
    directive: str | None = None  # "skip" or "run"
    argument: str = ""  # the skip's reason, or the run's variables


@dataclass
class Page:
    path: str  # relative to the repository
    text: str
    blocks: list = field(default_factory=list)
    anchors: set = field(default_factory=set)
    prose: list = field(default_factory=list)  # (line number, line) outside code blocks


@dataclass
class Call:
    """One recorded command: argv as bash expanded it, its directory and the variables it
    added to the environment."""

    block: Block
    argv: list
    cwd: str
    env: dict


class Report:
    def __init__(self, verbose=True):
        self.problems, self.notes, self.verbose = [], [], verbose

    def problem(self, where: str, message: str) -> None:
        self.problems.append(f"{where}: {message}")

    def note(self, where: str, message: str) -> None:
        self.notes.append(f"{where}: {message}")
        if self.verbose:
            print(f"  {where}: {message}", flush=True)


# ---------------------------------------------------------------- markdown


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def parse_page(path: str) -> Page:
    text = (REPO / path).read_text()
    page = Page(path, text)
    lines = text.split("\n")
    seen: dict[str, int] = {}
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if match:
            indent, fence, lang = match.groups()
            end = i + 1
            while end < len(lines) and not re.match(rf"^\s*{fence}\s*$", lines[end]):
                end += 1
            body = [line[len(indent):] if line.startswith(indent) else line.lstrip()
                    for line in lines[i + 1:end]]  # fmt: skip
            block = Block(path, i + 1, lang.lower(), "\n".join(body) + "\n")
            before = i - 1
            while before >= 0 and not lines[before].strip():
                before -= 1
            directive = DIRECTIVE.match(lines[before]) if before >= 0 else None
            if directive:
                block.directive, block.argument = directive.group(1), directive.group(2).strip()
            page.blocks.append(block)
            i = end + 1
            continue
        page.prose.append((i + 1, lines[i]))
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", lines[i])
        if heading:
            anchor = slug(heading.group(1))
            count = seen.get(anchor, 0)
            seen[anchor] = count + 1
            page.anchors.add(anchor if count == 0 else f"{anchor}-{count}")
        for explicit in re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", lines[i]):
            page.anchors.add(explicit)
        i += 1
    return page


def without_code_spans(line: str) -> str:
    return re.sub(r"(`+)(.+?)\1", "", line)


def code_spans(line: str) -> list:
    return [match[1] for match in re.findall(r"(`+)(.+?)\1", line)]


def links(line: str) -> list:
    return re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)",
                      without_code_spans(line))  # fmt: skip


def all_pages() -> list:
    pages = ["README.md"]
    pages += sorted(str(path.relative_to(REPO)) for path in (REPO / "docs").rglob("*.md"))
    return pages


def kind_of(page: Page) -> str | None:
    if page.path in GENERATED_WHOLE:
        return GENERATED_WHOLE[page.path][0]
    first = next((line for line in page.text.split("\n") if line.strip()), "")
    match = KIND_LINE.match(first)
    return match.group(1) if match else None


# ---------------------------------------------------------------- names and paths


def module_roots() -> list:
    """Where `megatron.*` modules live: the repository and megatron-core's installation."""
    import importlib.util

    roots = [REPO]
    spec = importlib.util.find_spec("megatron")
    for location in (spec.submodule_search_locations or []) if spec else []:
        parent = Path(location).parent
        if parent.resolve() != REPO.resolve():
            roots.append(parent)
    return roots


ROOTS: list = []


def module_file(name: str) -> Path | None:
    """The file (or package directory) of module `name`, without importing it."""
    global ROOTS
    if not ROOTS:
        ROOTS = module_roots()
    parts = name.split(".")
    for root in ROOTS:
        base = root.joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        if base.is_dir() and parts[0] == "megatron":
            return base  # a namespace package (megatron/, shared with megatron-core)
    return None


def top_level_names(path: Path) -> set | None:
    """Names a module defines at its top level; None when it cannot tell (star imports, a
    module `__getattr__`)."""
    if path.is_dir():
        return {child.stem for child in path.iterdir()}
    names = {child.stem for child in path.parent.iterdir()} if path.name == "__init__.py" else set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.add(alias.asname or alias.name.split(".")[0])
    if "__getattr__" in names:
        return None
    return names


def ours(module: str) -> bool:
    return module.split(".")[0] in ("megatron", "tools", "pretrain_gpt")


def check_module_name(dotted: str) -> str | None:
    """None when `dotted` (a module, or a module's attribute) exists, else why not."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        path = module_file(".".join(parts[:cut]))
        if path is None:
            continue
        if cut == len(parts):
            return None
        names = top_level_names(path)
        if names is None or parts[cut] in names:
            return None
        return f"{'.'.join(parts[:cut])} has no {parts[cut]}"
    return f"no module {dotted}"


def check_repo_path(path: str, cwd: Path = REPO) -> str | None:
    clean = path.rstrip(".,:;)")
    if clean in NOT_IN_A_CLONE or "<" in clean or "{" in clean:
        return None
    if "*" in clean:
        return None if list(cwd.glob(clean)) else f"nothing matches {clean}"
    target = (cwd / clean) if not clean.startswith("/") else Path(clean)
    return None if target.exists() else f"{clean} does not exist"


def check_python(code: str, where: str, report: Report, cwd: Path = REPO) -> None:
    """The snippet compiles, and every module, name and repository path it names exists."""
    try:
        tree = ast.parse(code)
    except SyntaxError as error:
        report.problem(where, f"python snippet does not compile: {error.msg} (line {error.lineno})")
        return
    modules: dict[str, str] = {}  # alias -> module
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if ours(alias.name):
                    problem = check_module_name(alias.name)
                    if problem:
                        report.problem(where, f"python snippet imports {alias.name}: {problem}")
                    elif alias.asname:
                        modules[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if not ours(node.module):
                continue
            if module_file(node.module) is None:
                report.problem(where, f"python snippet imports from {node.module}: no such module")
                continue
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                problem = check_module_name(full)
                if problem:
                    report.problem(where, f"`from {node.module} import {alias.name}`: {problem}")
                elif module_file(full) is not None:
                    modules[alias.asname or alias.name] = full
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            for path in REPO_PATH.findall(node.value):
                problem = check_repo_path(path, cwd)
                if problem and " " not in node.value.strip():
                    report.problem(where, f"python snippet names {problem}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in modules):  # fmt: skip
            problem = check_module_name(f"{modules[node.value.id]}.{node.attr}")
            if problem:
                report.problem(where, f"python snippet uses {node.value.id}.{node.attr}: {problem}")


# ---------------------------------------------------------------- page checks


def check_pages(pages: dict, report: Report) -> None:
    readme = pages["README.md"]
    if len(readme.text.encode()) > README_LIMIT:
        report.problem("README.md", f"{len(readme.text.encode()):,} bytes, over {README_LIMIT:,}")
    for path, page in pages.items():
        size = len(page.text.encode())
        if path != "README.md" and size > PAGE_LIMIT and path not in GENERATED_SIZE:
            report.problem(path, f"{size:,} bytes, over {PAGE_LIMIT:,}: split it")
        if path != "README.md" and kind_of(page) is None:
            report.problem(path, "the first line names no kind (*Guide*: , *Reference*: or "
                           "*Report*: )")  # fmt: skip
    check_index(pages, report)
    for path, page in pages.items():
        check_links(page, pages, report)
        check_inline_names(page, report)


def check_index(pages: dict, report: Report) -> None:
    index = pages.get("docs/index.md")
    if index is None:
        report.problem("docs/index.md", "missing")
        return
    if not any(target.split("#")[0] in ("docs/index.md",) for _, line in pages["README.md"].prose
               for target in links(line)):  # fmt: skip
        report.problem("README.md", "does not link docs/index.md")
    listed: dict[str, str] = {}
    group = None
    for number, line in index.prose:
        heading = re.match(r"^##\s+(.*?)\s*$", line)
        if heading:
            group = heading.group(1)
            continue
        for target in links(line):
            if re.match(r"^[a-z]+:", target):
                continue
            resolved = os.path.normpath(os.path.join("docs", target.split("#")[0]))
            listed[resolved] = group
    for path, page in pages.items():
        if path in ("README.md", "docs/index.md"):
            continue
        kind = kind_of(page)
        if path not in listed:
            report.problem("docs/index.md", f"does not link {path}")
        elif kind and listed[path] != KINDS[kind]:
            report.problem("docs/index.md", f"lists {path} under {listed[path]!r}, but the page "
                           f"is a {kind} (## {KINDS[kind]})")  # fmt: skip


def check_links(page: Page, pages: dict, report: Report) -> None:
    base = Path(page.path).parent
    for number, line in page.prose:
        for target in links(line):
            if re.match(r"^[a-z][a-z+.-]*:", target):
                continue
            where = f"{page.path}:{number}"
            file_part, _, anchor = target.partition("#")
            resolved = os.path.normpath(base / file_part) if file_part else page.path
            if not (REPO / resolved).exists():
                report.problem(where, f"link to {target}: {resolved} does not exist")
                continue
            if anchor and resolved.endswith(".md"):
                linked = pages.get(resolved) or parse_page(resolved)
                if anchor not in linked.anchors:
                    report.problem(where, f"link to {target}: no heading #{anchor} in {resolved}")


def check_inline_names(page: Page, report: Report) -> None:
    """Repository paths and megatron module names in inline code exist."""
    for number, line in page.prose:
        for span in code_spans(line):
            where = f"{page.path}:{number}"
            if re.search(r"\s(would|was|were|no longer)\b", span):
                continue
            for path in REPO_PATH.findall(span):
                problem = check_repo_path(path)
                if problem:
                    report.problem(where, f"`{span}`: {problem}")
            for dotted in MODULE_NAME.findall(span):
                problem = check_module_name(dotted)
                if problem:
                    report.problem(where, f"`{span}`: {problem}")


# ---------------------------------------------------------------- record mode


PRELUDE = r"""
__docs_check_record() {
  local file
  file=$(mktemp "$DOCS_CHECK_LOG/call.XXXXXXXX")
  { printf '%s\0' "$PWD" "$#" "$@"; env -0; } > "$file"
  return 0
}
__docs_check_script() {  # an example script runs, in record mode, with its own $0
  DOCS_CHECK_IN_SCRIPT=1 command bash -c '. "$DOCS_CHECK_PRELUDE"; . "$0"' "$@"
}
bash() {
  if [ -f "${1:-}" ]; then __docs_check_script "$@"; else __docs_check_record bash "$@"; fi
}
sh() { bash "$@"; }
nice() {
  while [ $# -gt 0 ]; do
    case "$1" in -n) shift 2 ;; -n*|-[0-9]*|--adjustment=*) shift ;; *) break ;; esac
  done
  "$@"
}
exec() {  # `exec COMMAND` records COMMAND too, and ends the script as exec would
  if [ $# -eq 0 ]; then builtin exec; return; fi
  "$@"
  exit $?
}
timeout() {
  while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done
  shift
  "$@"
}
"""


def prelude(names: set, scripts: set) -> str:
    lines = [PRELUDE]
    for name in sorted(names):
        # a launch prints a line, as a real one would (`torchrun ... | grep -v ...` then passes)
        say = f"; echo '[docs-check] recorded {name}'" if name.endswith("torchrun") else ""
        lines.append(f'{name}() {{ __docs_check_record {shlex.quote(name)} "$@"{say}; }}')
    for script in sorted(scripts):
        lines.append(f'{script}() {{ __docs_check_script {shlex.quote(script)} "$@"; }}')
    return "\n".join(lines) + "\n"


def recorded_names(text: str) -> tuple:
    names = set(RECORDED)
    prefixes = ("", "./", "../", "../../", "../../../", f"{REPO}/")
    names.update(f"{prefix}.venv/bin/{tool}" for prefix in prefixes for tool in VENV_TOOLS)
    names.update(re.findall(r"(?<![\w/])((?:\.\./)*\.venv/bin/[\w.-]+)", text))
    scripts = set()
    for token in re.findall(
        r"(?<![\w/$-])((?:\./)?(?:examples|tools)/[\w./-]+\.(?:sh|slurm))", text
    ):
        if os.access(REPO / token, os.X_OK):
            scripts.add(token)
    return names, scripts


def record(block: Block, report: Report, extra_env: dict | None = None) -> list:
    """Run a shell block in record mode; the commands it would have run."""
    text = block.text
    if block.lang == "console":
        text = console_commands(text)
    where = f"{block.page}:{block.line}"
    with tempfile.TemporaryDirectory(prefix="docs_check_") as tmp:
        log = Path(tmp) / "log"
        log.mkdir()
        names, scripts = recorded_names(text)
        # scripts the block runs may call more of our scripts and tools
        for script in list(scripts):
            more_names, more_scripts = recorded_names((REPO / script).read_text())
            names |= more_names
            scripts |= more_scripts
        prelude_path = Path(tmp) / "prelude.sh"
        prelude_path.write_text(prelude(names, scripts))
        shim = Path(tmp) / "bin"  # a command run by a path bash cannot intercept still records
        shim.mkdir()
        for tool in ("python", "python3", "torchrun", "sbatch", "srun"):
            (shim / tool).write_text(
                f'#!/bin/bash\n. {shlex.quote(str(prelude_path))}\n{tool} "$@"\n'
            )
            (shim / tool).chmod(0o755)
        env = dict(os.environ, DOCS_CHECK_LOG=str(log), DOCS_CHECK_PRELUDE=str(prelude_path),
                   PATH=f"{shim}:{os.environ.get('PATH', '')}", CUDA_VISIBLE_DEVICES="")  # fmt: skip
        env.update(extra_env or {})
        script = f". {shlex.quote(str(prelude_path))}\nset -eo pipefail\n{text}"
        base_env = dict(env)
        try:
            result = subprocess.run(["bash", "-c", script], cwd=REPO, env=env, text=True,
                                    capture_output=True, timeout=120, start_new_session=True)  # fmt: skip
        except subprocess.TimeoutExpired:
            report.problem(where, "record mode did not finish in 120 s (does it run something "
                           "for real?)")  # fmt: skip
            return []
        if result.returncode != 0:
            tail = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
            report.problem(where, f"the block fails as written (exit {result.returncode}): {tail}")
        calls = []
        for file in sorted(log.iterdir(), key=lambda f: f.stat().st_mtime_ns):
            fields = file.read_bytes().split(b"\0")
            cwd, count = fields[0].decode(), int(fields[1])
            argv = [f.decode() for f in fields[2 : 2 + count]]
            call_env = dict(f.decode().split("=", 1) for f in fields[2 + count :] if b"=" in f)
            added = {key: value for key, value in call_env.items()
                     if key not in base_env or base_env[key] != value}  # fmt: skip
            added.pop("OLDPWD", None)
            added.pop("_", None)
            calls.append(Call(block, argv, cwd, added))
        return calls


def console_commands(text: str) -> str:
    """The commands of a console transcript: lines starting with `$ ` and their continuations."""
    commands, going = [], False
    for line in text.split("\n"):
        if line.startswith("$ "):
            commands.append(line[2:])
            going = line.endswith("\\")
        elif going:
            commands.append(line)
            going = line.endswith("\\")
    return "\n".join(commands) + "\n"


# ---------------------------------------------------------------- recorded commands


@dataclass
class Checks:
    """What the recorded commands need checked beyond the cheap part."""

    pretrain: list = field(default_factory=list)  # (where, argv, world size)
    tools: list = field(default_factory=list)  # (where, script, args, cwd, env)
    pytest: list = field(default_factory=list)  # (where, args, cwd, env)
    counts: dict = field(default_factory=dict)
    made: dict = field(default_factory=dict)  # block -> what its `make` commands build


TORCHRUN_VALUE_OPTIONS = {"--nproc-per-node", "--nproc_per_node", "--nnodes", "--node-rank",
                          "--node_rank", "--rdzv-backend", "--rdzv_backend", "--rdzv-endpoint",
                          "--rdzv_endpoint", "--rdzv-id", "--rdzv_id", "--rdzv-conf",
                          "--master-addr", "--master_addr", "--master-port", "--master_port",
                          "--max-restarts", "--max_restarts", "--monitor-interval", "--log-dir",
                          "--log_dir", "-r", "--redirects", "-t", "--tee", "--local-addr",
                          "--role", "--start-method", "--local-ranks-filter"}  # fmt: skip


def torchrun_split(args: list) -> tuple:
    """torchrun's options -> (world size, script and its arguments)."""
    nproc, nnodes, i = 1, 1, 0
    while i < len(args) and args[i].startswith("-"):
        option, _, inline = args[i].partition("=")
        value = inline if inline else (args[i + 1] if i + 1 < len(args) else "")
        if option in TORCHRUN_VALUE_OPTIONS:
            if option in ("--nproc-per-node", "--nproc_per_node") and value.isdigit():
                nproc = int(value)
            if option == "--nnodes":
                nnodes = int(value.split(":")[-1]) if value.split(":")[-1].isdigit() else 1
            i += 1 if inline else 2
        else:
            i += 1
    return nproc * nnodes, args[i:]


def makefile_targets() -> set:
    targets = set()
    for line in (REPO / "Makefile").read_text().split("\n"):
        match = re.match(r"^([\w./$() -]+?)\s*:(?!=)", line)
        if match and not line.startswith("\t"):
            targets.update(match.group(1).split())
    return targets


def check_call(call: Call, checks: Checks, report: Report) -> None:
    where = f"{call.block.page}:{call.block.line}"
    name = os.path.basename(call.argv[0])
    args = call.argv[1:]
    cwd = Path(call.cwd)
    if call.argv[0] in ("python", "python3", "torchrun", "pytest") and not call.env.get(
        "DOCS_CHECK_IN_SCRIPT"
    ):
        report.problem(where, f"`{call.argv[0]}` is not on the PATH of a fresh clone: "
                       f"write .venv/bin/{call.argv[0]}")  # fmt: skip
    if name in CLUSTER:
        report.problem(where, f"`{call.argv[0]}` cannot run here: mark the block "
                       "`<!-- docs-check: skip (why) -->`")  # fmt: skip
        return
    if name == "make":
        known = makefile_targets()
        for target in [a for a in args if not a.startswith("-") and "=" not in a]:
            if target not in known:
                report.problem(where, f"make {target}: no such target in the Makefile")
            if target in MAKE_OUTPUTS:
                checks.made.setdefault(id(call.block), set()).add(MAKE_OUTPUTS[target])
        checks.counts["make"] = checks.counts.get("make", 0) + 1
        return
    if name == "bash":
        report.problem(where, f"bash {' '.join(args)[:60]}: not a script of the repository")
        return
    world = int(call.env.get("WORLD_SIZE", "1"))
    if name == "torchrun":
        world, args = torchrun_split(args)
    elif name == "pytest":
        args = ["-m", "pytest"] + args
    # python [options] (-m module | -c code | script) args
    while args and args[0].startswith("-") and args[0] not in ("-m", "-c"):
        args = args[2:] if args[0] in ("-W", "-X") else args[1:]
    if not args:
        report.problem(where, f"`{' '.join(call.argv)}`: nothing to run")
        return
    if args[0] == "-c":
        check_python(args[1], f"{where} (python -c)", report, cwd)
        checks.counts["python -c"] = checks.counts.get("python -c", 0) + 1
        return
    if args[0] == "-m":
        module, rest = args[1], args[2:]
        if module == "pytest":
            check_pytest(call, rest, checks, report)
        elif module == "torch.distributed.run":
            world, rest = torchrun_split(rest)
            check_script(call, rest, world, checks, report)
        elif ours(module):
            problem = check_module_name(module)
            if problem:
                report.problem(where, f"python -m {module}: {problem}")
            else:
                checks.tools.append((where, module, rest, call.cwd, call.env))
        return
    check_script(call, args, world, checks, report)


def check_script(call: Call, args: list, world: int, checks: Checks, report: Report) -> None:
    where = f"{call.block.page}:{call.block.line}"
    script, rest = args[0], args[1:]
    path = (Path(call.cwd) / script).resolve()
    if not path.exists():
        report.problem(where, f"{script} does not exist")
        return
    relative = os.path.relpath(path, REPO)
    made = checks.made.get(id(call.block), set())
    if relative == "pretrain_gpt.py":
        checks.pretrain.append((where, rest, world, call.cwd, made))
        checks.counts["pretrain_gpt.py"] = checks.counts.get("pretrain_gpt.py", 0) + 1
        return
    if relative in PRETRAIN_PASSTHROUGH and "--" in rest:
        cut = rest.index("--")
        option = PRETRAIN_PASSTHROUGH[relative]
        if option and option in rest[:cut]:
            world = int(rest[rest.index(option) + 1])
        elif option:
            world = 4
        checks.pretrain.append((where, rest[cut + 1 :], world, call.cwd, made))
    checks.tools.append((where, str(path), rest, call.cwd, call.env))
    checks.counts[relative] = checks.counts.get(relative, 0) + 1


def check_pytest(call: Call, args: list, checks: Checks, report: Report) -> None:
    where = f"{call.block.page}:{call.block.line}"
    skip_next = False
    for arg in args:
        if skip_next:
            skip_next = False
            continue
        if arg in PYTEST_VALUE_OPTIONS:
            skip_next = True
            continue
        if arg.startswith("-"):
            continue
        problem = check_repo_path(arg.split("::")[0], Path(call.cwd))
        if problem:
            report.problem(where, f"pytest: {problem}")
    cases = [name for name in call.env.get("FUNCTIONAL_CASES", "").split(",") if name]
    known = {path.name for path in (REPO / "tests/functional_tests/test_cases").glob("*/*")}
    for case in cases:
        if case not in known:
            report.problem(where, f"FUNCTIONAL_CASES names {case}: no such functional case")
    checks.pytest.append((where, args, call.cwd, call.env))
    checks.counts["pytest"] = checks.counts.get("pytest", 0) + 1


# ---------------------------------------------------------------- pretrain_gpt.py's parser


def validate_pretrain_lines(jobs: list) -> list:
    """For each [argv, world size, directory, check files]: None when pretrain_gpt.py's parser
    and validate_args() accept the command line there, else its one error line."""
    import contextlib
    import io

    from megatron.common.errors import UserError
    from megatron.training.arguments import build_parser, validate_args

    results, start = [], os.getcwd()
    try:
        for argv, world, cwd, check_files in jobs:
            os.chdir(cwd)
            stderr = io.StringIO()
            try:
                with contextlib.redirect_stderr(stderr):
                    args = build_parser().parse_args(argv)
                validate_args(args, world_size=world, check_files=check_files)
                results.append(None)
            except SystemExit:
                lines = stderr.getvalue().strip().splitlines() or ["argparse error"]
                results.append(lines[-1])
            except UserError as error:
                results.append(f"error: {error}")
    finally:
        os.chdir(start)
    return results


def python_executable() -> str:
    venv = REPO / ".venv" / "bin" / "python"
    return str(venv) if venv.exists() else sys.executable


RESULTS = "DOCS-CHECK-RESULTS "


def check_pretrain(checks: Checks, report: Report, in_process: bool = False) -> None:
    """Every pretrain_gpt.py command line through build_parser() and validate_args(), in this
    process or in one of the venv's python."""
    if not checks.pretrain:
        return
    jobs = []
    for where, argv, world, cwd, made in checks.pretrain:
        missing_but_made = False
        for i, arg in enumerate(argv[:-1]):
            paths = []
            if arg in INPUT_FILE_FLAGS:
                paths = [argv[i + 1]]
            if arg in DATA_PREFIX_FLAGS:
                for prefix in argv[i + 1 :]:
                    if prefix.startswith("--"):
                        break
                    if not re.fullmatch(r"[\d.eE+-]+", prefix):  # not a blend's weight
                        paths.append(f"{prefix}.idx")
            for path in paths:
                if (Path(cwd) / path).exists():
                    continue
                if any(path.startswith(output) for output in made):
                    missing_but_made = True  # the block's `make` builds it
                    continue
                report.problem(where, f"pretrain_gpt.py {arg}: {path} does not exist")
        jobs.append([argv, world, cwd, not missing_but_made])
    if in_process:
        results = validate_pretrain_lines(jobs)
    else:  # a process of the venv's python, whatever runs this script
        env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        result = subprocess.run(
            [python_executable(), __file__, "--validate-pretrain"],
            input=json.dumps(jobs),
            text=True,
            capture_output=True,
            cwd=REPO,
            env=env,
            timeout=600,
        )
        marker = [line for line in result.stdout.splitlines() if line.startswith(RESULTS)]
        if not marker:
            report.problem("pretrain_gpt.py", f"the flag validator failed: {result.stderr[-2000:]}")
            return
        results = json.loads(marker[0][len(RESULTS) :])
    for (where, argv, world, _, _), error in zip(checks.pretrain, results):
        if error:
            report.problem(where, f"pretrain_gpt.py at world size {world}: {error}")


# ---------------------------------------------------------------- the full check

DRY_PARSE = r"""
import argparse, os, runpy, sys
depth = [0]
def stop_after(name):
    original = getattr(argparse.ArgumentParser, name)
    def parse(self, *args, **kwargs):
        depth[0] += 1
        try:
            result = original(self, *args, **kwargs)
        finally:
            depth[0] -= 1
        if depth[0] == 0:
            sys.stdout.write("\nDOCS-CHECK-PARSED\n")
            sys.stdout.flush()
            os._exit(0)
        return result
    setattr(argparse.ArgumentParser, name, parse)
stop_after("parse_args")
stop_after("parse_known_args")
target, sys.argv = sys.argv[1], sys.argv[1:]
if target.endswith(".py"):
    sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
    runpy.run_path(target, run_name="__main__")
else:
    runpy.run_module(target, run_name="__main__", alter_sys=True)
print("DOCS-CHECK-NO-PARSER")
"""


def run_tool_parsers(checks: Checks, report: Report) -> None:
    seen = set()
    for where, target, args, cwd, env in checks.tools:
        key = (target, tuple(args), cwd)
        if key in seen:
            continue
        seen.add(key)
        shown = os.path.relpath(target, REPO) if target.startswith("/") else target
        start = time.monotonic()
        result = subprocess.run([python_executable(), "-c", DRY_PARSE, target] + args, cwd=cwd,
                                env=dict(os.environ, **env, OMP_NUM_THREADS="1",
                                         CUDA_VISIBLE_DEVICES=""),
                                text=True, capture_output=True, timeout=300)  # fmt: skip
        seconds = time.monotonic() - start
        if "DOCS-CHECK-PARSED" in result.stdout:
            report.note(where, f"{shown}: its parser accepts the flags ({seconds:.1f} s)")
        elif result.returncode == 0 and "--help" in args and "usage:" in result.stdout:
            report.note(where, f"{shown}: --help prints its usage ({seconds:.1f} s)")
        elif "DOCS-CHECK-NO-PARSER" in result.stdout and result.returncode == 0:
            report.note(where, f"{shown}: ran without an argument parser ({seconds:.1f} s)")
        else:
            tail = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
            report.problem(where, f"{shown} {' '.join(args)[:80]}: {tail}")


PYTEST_VALUE_OPTIONS = ("-k", "-m", "-p", "-o", "--durations", "-n", "--deselect")


def pytest_paths(args: list, cwd: str) -> list:
    """The test files and directories a pytest command line names, as absolute paths."""
    paths, skip_next = [], False
    for arg in args:
        if skip_next:
            skip_next = False
        elif arg in PYTEST_VALUE_OPTIONS:
            skip_next = True
        elif not arg.startswith("-"):
            paths.append(str((Path(cwd) / arg.split("::")[0]).resolve()))
    return paths


def run_pytest_collection(checks: Checks, report: Report) -> None:
    """Every test file the pytest commands name, collected in one pytest process (what a
    command selects with FUNCTIONAL_CASES or -k is checked by the quick part)."""
    if not checks.pytest:
        return
    paths = sorted({path for _, args, cwd, _ in checks.pytest for path in pytest_paths(args, cwd)})
    start = time.monotonic()
    command = [python_executable(), "-m", "pytest", "--collect-only", "-q", "-p",
               "no:cacheprovider"] + paths  # fmt: skip
    # pytest prints its summary, then waits for what the suite's collection hooks started (the
    # functional tests' frozen-run scenarios): the summary is all this needs
    process = subprocess.Popen(command, cwd=REPO, text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    lines, returncode = [], None
    for line in process.stdout:
        lines.append(line)
        if re.search(r"(collected|errors?) in [\d.]+s", line):
            returncode = 0 if re.search(r"\d+ tests? collected in", line) else 1
            break
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
    process.wait()
    output = "".join(lines)
    status = process.returncode if returncode is None else returncode
    seconds = time.monotonic() - start
    summary = (output.strip().splitlines() or ["(no output)"])[-1]
    failed = set(re.findall(r"ERROR collecting (\S+)", output))
    for where, args, cwd, _ in checks.pytest:
        mine = [os.path.relpath(path, REPO) for path in pytest_paths(args, cwd)]
        bad = [
            path for path in mine if any(path.startswith(f) or f.startswith(path) for f in failed)
        ]
        if bad or (status != 0 and not failed):
            report.problem(where, f"pytest --collect-only {' '.join(mine)[:80]}: {summary}")
    if status == 0:
        report.note("pytest", f"{len(paths)} paths collect: {summary} ({seconds:.0f} s)")


def run_block(block: Block, report: Report) -> None:
    """Run a block for real, from the repository root, with the variables of its directive."""
    where = f"{block.page}:{block.line}"
    variables = dict(item.split("=", 1) for item in shlex.split(block.argument) if "=" in item)
    text = console_commands(block.text) if block.lang == "console" else block.text
    env = dict(os.environ, **variables)
    shown = " ".join(f"{k}={v}" for k, v in variables.items())
    start = time.monotonic()
    # as a shell runs it, stopping at the first failing command (a pipeline's status is its
    # last command's, as without pipefail)
    process = subprocess.Popen(["nice", "-n", "10", "bash", "-e", "-c", text],
                               cwd=REPO, env=env, text=True, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        output, _ = process.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGTERM)
        output, _ = process.communicate()
        report.problem(where, f"ran past 900 s ({shown})")
        return
    seconds = time.monotonic() - start
    if process.returncode == 0:
        report.note(where, f"ran for real{' with ' + shown if shown else ''}: {seconds:.0f} s")
    else:
        lines = output.strip().splitlines()
        errors = [line for line in lines if re.search(r"\berror\b", line, re.I)]
        tail = " | ".join((errors[:2] or []) + lines[-2:])
        report.problem(where, f"exit {process.returncode} after {seconds:.0f} s ({shown}): {tail}")


def run_python_block(block: Block, report: Report) -> None:
    where = f"{block.page}:{block.line}"
    start = time.monotonic()
    result = subprocess.run([python_executable(), "-c", block.text], cwd=REPO, text=True,
                            capture_output=True, timeout=600,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))  # fmt: skip
    seconds = time.monotonic() - start
    if result.returncode == 0:
        report.note(where, f"python snippet ran: {seconds:.1f} s")
    else:
        tail = (result.stderr.strip().splitlines() or ["(no output)"])[-1]
        report.problem(where, f"python snippet failed: {tail}")


# ---------------------------------------------------------------- driver


def executable_pages(pages: dict) -> list:
    """README.md, the guides and the reference pages: their commands must run as written (a
    report's commands are the record of what was measured, kept as they ran)."""
    return [
        page
        for path, page in pages.items()
        if path == "README.md" or kind_of(page) in ("Guide", "Reference")
    ]


def check(
    quick: bool,
    verbose: bool = True,
    only: list | None = None,
    pages: dict | None = None,
    in_process: bool = False,
) -> Report:
    """The pages' checks (unless `pages` are given: then they were checked), then the
    commands'; `quick`: the static part only."""
    report = Report(verbose)
    if pages is None:
        pages = {path: parse_page(path) for path in all_pages()}
        check_pages(pages, report)
    for page in pages.values():  # python snippets on every page, runnable or not
        for block in page.blocks:
            if block.lang in ("python", "py") and block.directive != "skip":
                check_python(block.text, f"{page.path}:{block.line}", report)
    checks = Checks()
    to_run, skipped, python_blocks = [], [], []
    for page in executable_pages(pages):
        if only and page.path not in only:
            continue
        for block in page.blocks:
            where = f"{page.path}:{block.line}"
            if block.directive == "skip":
                if not re.match(r"^\(.+\)$", block.argument):
                    report.problem(
                        where, "a skip needs its reason: <!-- docs-check: skip (why) -->"
                    )
                skipped.append((where, block.argument.strip("()")))
                continue
            if block.lang in ("python", "py"):
                python_blocks.append(block)
            if not block.lang and COMMAND_LINE.match(block.text):
                report.problem(where, "a command in a block without a language: label it bash")
            if block.lang not in SHELL_LANGS:
                continue
            for call in record(block, report):
                check_call(call, checks, report)
            if block.directive == "run":
                to_run.append(block)
    check_pretrain(checks, report, in_process)
    if verbose:
        counted = ", ".join(f"{name} x{count}" for name, count in sorted(checks.counts.items()))
        print(f"recorded commands: {counted}")
        print(f"pretrain_gpt.py command lines parsed and validated: {len(checks.pretrain)}")
        for where, reason in skipped:
            print(f"  skipped {where}: {reason}")
    if not quick:
        print("tools' own parsers:", flush=True)
        run_tool_parsers(checks, report)
        print("pytest collection:", flush=True)
        run_pytest_collection(checks, report)
        print("blocks run for real:", flush=True)
        for block in to_run:
            run_block(block, report)
        for block in python_blocks:
            run_python_block(block, report)
    report.skipped = skipped
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="the static checks only: no tool parser, collection or real run")  # fmt: skip
    parser.add_argument("--page", action="append", default=None,
                        help="check the commands of this page only (repeatable)")  # fmt: skip
    parser.add_argument("--validate-pretrain", action="store_true", help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.validate_pretrain:  # check_pretrain's process: jobs on stdin, results out
        print(RESULTS + json.dumps(validate_pretrain_lines(json.load(sys.stdin))))
        return 0
    start = time.monotonic()
    report = check(options.quick, verbose=True, only=options.page)
    for problem in report.problems:
        print(f"PROBLEM {problem}")
    seconds = time.monotonic() - start
    print(f"docs-check: {len(report.problems)} problems, {len(report.skipped)} blocks skipped, "
          f"{seconds:.0f} s")  # fmt: skip
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
