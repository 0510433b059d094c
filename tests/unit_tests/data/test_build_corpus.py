import json

from megatron.training.data import corpus


def _tree(root):
    files = {
        "a.py": "print('a')\n",
        "b.txt": "not python",
        "pkg/__init__.py": "",
        "pkg/z.py": "Z = 'é'\n",
        "pkg/m.py": "M = 1\n",
        "site-packages/third.py": "THIRD = 1\n",
        "pkg/__pycache__/m.py": "CACHED = 1\n",
        "test/test_a.py": "TEST = 1\n",
    }
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    (root / "latin1.py").write_bytes("X = 'é'\n".encode("latin-1"))


def _texts(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def test_sorted_filtered_and_deterministic(tmp_path):
    _tree(tmp_path / "lib")
    out = tmp_path / "corpus.jsonl"
    stats = corpus.build_corpus(str(out), root=str(tmp_path / "lib"))
    assert _texts(out) == ["print('a')\n", "M = 1\n", "Z = 'é'\n"]
    assert stats["documents"] == 3 and stats["skipped"] == 2  # empty __init__, latin-1
    first = out.read_bytes()
    corpus.build_corpus(str(out), root=str(tmp_path / "lib"))
    assert out.read_bytes() == first

    corpus.build_corpus(str(out), root=str(tmp_path / "lib"), include_tests=True, max_docs=4)
    assert _texts(out)[-1] == "TEST = 1\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl", "lib"]


def test_cli_on_the_real_stdlib(tmp_path, capsys):
    out = tmp_path / "stdlib.jsonl"
    assert corpus.main(["--output", str(out), "--max-docs", "3"]) == 0
    assert "3 documents" in capsys.readouterr().out
    assert len(_texts(out)) == 3
    assert corpus.main(["--output", str(out), "--max-docs", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: --max-docs")
