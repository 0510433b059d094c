"""Helpers shared by the data tests (imported by conftest.py and the test modules)."""

import os

import numpy

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
TINY_VOCAB_SIZE = 320


def tiny_documents():
    """A few dozen small, code-like documents with indentation, newlines and non-ASCII text."""
    words = ["value", "other", "result", "count", "name", "items", "total", "index"]
    docs = []
    for i in range(40):
        a, b = words[i % len(words)], words[(3 * i + 1) % len(words)]
        docs.append(
            f"def compute_{a}_{i}({a}, {b}=None):\n"
            f'    """Return the {a} combined with the {b} ({i} times)."""\n'
            f"    if {b} is None:\n"
            f"        return {a} * {i}\n"
            f"    for step in range({i}):\n"
            f"        {a} = {a} + {b}  # café, naïve\n"
            f"    return {a}\n"
        )
    return docs


def write_indexed_dataset(prefix: str, documents, dtype=numpy.uint16) -> None:
    """Write documents (lists of ids) with megatron-core's builder."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for doc in documents:
        builder.add_document(numpy.asarray(doc, dtype=dtype), [len(doc)])
    builder.finalize(prefix + ".idx")


def random_documents(n_docs: int, vocab: int, seed: int = 0, eod=None):
    """Deterministic documents of 20-150 ids in [0, vocab - 1), each ending with ``eod``."""
    eod = vocab - 1 if eod is None else eod
    rng = numpy.random.default_rng(seed)
    docs = []
    for _ in range(n_docs):
        length = int(rng.integers(20, 150))
        docs.append(rng.integers(0, vocab - 1, size=length).tolist() + [eod])
    return docs
