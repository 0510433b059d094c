"""Write a jsonl text corpus from the Python standard library sources of this interpreter.

Nothing is downloaded: the corpus is the ``.py`` files under ``sysconfig`` 's ``stdlib`` path,
walked in sorted order so the output is byte-identical from run to run for one Python build.
Third-party packages (``site-packages``/``dist-packages``), byte-code caches and, unless
``--include-tests`` is given, the standard library's own test suites are skipped, as are files
that cannot be read or are not valid UTF-8. Each line of the output is ``{"text": <source>}``.

Example::

    python tools/build_corpus.py --output data/stdlib.jsonl
"""

import argparse
import json
import os
import sys
import sysconfig
import time

_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})


from megatron.common.errors import UserError


def iter_source_files(root: str, include_tests: bool = False):
    """Yield the paths of the ``.py`` files under ``root`` in a deterministic (sorted) order."""
    skipped = _SKIPPED_DIRS if include_tests else _SKIPPED_DIRS | _TEST_DIRS
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skipped)
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield os.path.join(dirpath, name)


def read_source(path: str):
    """Return the file's text, or None when it is unreadable, not UTF-8 or empty."""
    try:
        with open(path, "rb") as f:
            text = f.read().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return text if text.strip() else None


def build_corpus(output: str, max_docs=None, include_tests: bool = False, root=None) -> dict:
    """Write the corpus to ``output`` atomically and return counts of what was written."""
    root = root or sysconfig.get_paths()["stdlib"]
    if not os.path.isdir(root):
        raise UserError(f"standard library directory not found: {root}")
    out_dir = os.path.dirname(os.path.abspath(output))
    os.makedirs(out_dir, exist_ok=True)
    tmp = f"{output}.tmp-{os.getpid()}"
    stats = {"documents": 0, "bytes": 0, "skipped": 0, "root": root}
    try:
        with open(tmp, "w", encoding="utf-8") as out:
            for path in iter_source_files(root, include_tests):
                if max_docs is not None and stats["documents"] >= max_docs:
                    break
                text = read_source(path)
                if text is None:
                    stats["skipped"] += 1
                    continue
                out.write(json.dumps({"text": text}) + "\n")
                stats["documents"] += 1
                stats["bytes"] += len(text.encode("utf-8"))
        os.replace(tmp, output)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return stats


def get_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="path of the jsonl file to write")
    parser.add_argument("--max-docs", type=int, default=None, help="stop after this many files")
    parser.add_argument(
        "--include-tests", action="store_true", help="also include the stdlib's test suites"
    )
    args = parser.parse_args(argv)
    if args.max_docs is not None and args.max_docs < 1:
        raise UserError(f"--max-docs must be positive, got {args.max_docs}")
    return args


def main(argv=None) -> int:
    try:
        args = get_args(argv)
        start = time.time()
        stats = build_corpus(args.output, args.max_docs, args.include_tests)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(
        f"Wrote {args.output}: {stats['documents']} documents, {stats['bytes'] / 1e6:.2f} MB "
        f"from {stats['root']} ({stats['skipped']} skipped) in {time.time() - start:.1f} s"
    )
    return 0
