# Quickstart targets. Everything the project needs is installed into .venv/ by `make venv`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCHRUN := $(VENV)/bin/torchrun
DATA := data
CORPUS := $(DATA)/stdlib.jsonl
TOKENIZER := $(DATA)/tokenizer/stdlib.model
DATASET := $(DATA)/stdlib_text_document

.PHONY: venv data data-gpt2 data-small data-small-tests demo test test-quick cluster-test unit-test functional-test lint format clean docs-check

venv: $(VENV)/.installed

# Every package at the exact version in constraints.txt (README.md, "Dependencies"); the build
# uses the venv's pinned setuptools instead of an isolated, unpinned one.
$(VENV)/.installed: setup.py constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c constraints.txt pip setuptools
	$(PY) -m pip install --quiet -c constraints.txt --no-build-isolation -e ".[dev]" \
		--config-settings editable_mode=compat
	touch $@

# The default corpus: the Python standard library's sources, present on every machine.
$(CORPUS): | venv
	$(PY) tools/build_corpus.py --output $@

$(TOKENIZER): $(CORPUS)
	$(PY) tools/train_tokenizer.py --input $(CORPUS) --json-key text \
		--output-prefix $(DATA)/tokenizer/stdlib --vocab-size 8192

$(DATASET).idx: $(TOKENIZER)
	$(PY) tools/preprocess_data.py --input $(CORPUS) --json-keys text --output-prefix $(DATA)/stdlib \
		--tokenizer-type SentencePieceTokenizer --tokenizer-model $(TOKENIZER) --append-eod --workers 2

data: $(DATASET).idx

# GPT-2 style BPE (Megatron's default GPT2BPETokenizer) trained on the default corpus, and the
# corpus tokenized with it: --vocab-file data/gpt2/vocab.json --merge-file data/gpt2/merges.txt
#   --data-path data/stdlib_gpt2_text_document
GPT2_VOCAB := $(DATA)/gpt2/vocab.json
GPT2_DATASET := $(DATA)/stdlib_gpt2_text_document

$(GPT2_VOCAB): $(CORPUS)
	$(PY) tools/train_gpt2_bpe.py --input $(CORPUS) --output-dir $(DATA)/gpt2 --vocab-size 8192

$(GPT2_DATASET).idx: $(GPT2_VOCAB)
	$(PY) tools/preprocess_data.py --input $(CORPUS) --json-keys text --output-prefix $(DATA)/stdlib_gpt2 \
		--tokenizer-type GPT2BPETokenizer --vocab-file $(GPT2_VOCAB) --merge-file $(DATA)/gpt2/merges.txt \
		--append-eod --workers 2

data-gpt2: $(GPT2_DATASET).idx

# The convergence studies' small model (tools/time_to_accuracy.py --model small, small-moe):
# the default corpus with a 1,024-token SentencePiece model (docs/convergence.md).
SMALL := runs/data_v1k
SMALL_TOKENIZER := $(SMALL)/tokenizer/stdlib1k.model

$(SMALL_TOKENIZER): $(CORPUS)
	$(PY) tools/train_tokenizer.py --input $(CORPUS) --json-key text \
		--output-prefix $(SMALL)/tokenizer/stdlib1k --vocab-size 1024

$(SMALL)/stdlib_text_document.idx: $(SMALL_TOKENIZER)
	$(PY) tools/preprocess_data.py --input $(CORPUS) --json-keys text --output-prefix $(SMALL)/stdlib \
		--tokenizer-type SentencePieceTokenizer --tokenizer-model $(SMALL_TOKENIZER) --append-eod --workers 1

data-small: $(SMALL)/stdlib_text_document.idx

# The same tokenizer over the standard library with its test suites (2.7x the tokens, 13.2M):
# the deep model's 8.2M training tokens in one pass, where the default corpus repeats
# (tools/studies/deep_8x.sh's *-onepass runs).
SMALL_TESTS := runs/data_v1k_tests

$(SMALL_TESTS)/stdlib_tests.jsonl: | venv
	$(PY) tools/build_corpus.py --include-tests --output $@

$(SMALL_TESTS)/stdlib_text_document.idx: $(SMALL_TESTS)/stdlib_tests.jsonl $(SMALL_TOKENIZER)
	$(PY) tools/preprocess_data.py --input $< --json-keys text --output-prefix $(SMALL_TESTS)/stdlib \
		--tokenizer-type SentencePieceTokenizer --tokenizer-model $(SMALL_TOKENIZER) --append-eod --workers 1

data-small-tests: $(SMALL_TESTS)/stdlib_text_document.idx

# 4-stage CPU pretraining with 1F1B-flush, then PACI, on the same data; prints both side by side.
demo: venv data
	bash examples/paci/demo_cpu.sh

# The whole suite in three parts: the case batch (the functional tests marked `cases`: some
# 330 runs in 4-process launches, two launches at a time) with the case tests' single-process
# references started beside it (marked `beside_cases`, tests/functional_tests/background.py),
# the other functional tests (each file on one of two pytest-xdist workers: their module
# fixtures launch runs that the file's tests share; the hang scenarios start with the part),
# then the unit tests on both cores. (Running the parts side by side oversubscribed
# the two cores, cost more CPU and made a timing-sensitive test fail; the last two in one
# pytest-xdist session took 7 min 42 s against 7 min 2 s one after the other.) Every part runs;
# the target fails if any did, and ends with every part's failed tests (a log's tail names them).
PYTEST := $(PY) -m pytest -q -p no:cacheprovider $(PYTEST_FLAGS)

test: venv data
	@logs=$$(mktemp -d); \
	{ $(PYTEST) -m "cases or beside_cases" tests/functional_tests; echo $$? >$$logs/cases; } 2>&1 \
		| tee $$logs/cases.log; \
	{ $(PYTEST) -n 2 --dist loadfile -m "not cases and not beside_cases" tests/functional_tests; \
		echo $$? >$$logs/rest; } 2>&1 | tee $$logs/rest.log; \
	{ $(PYTEST) -n 2 tests/unit_tests; echo $$? >$$logs/unit; } 2>&1 | tee $$logs/unit.log; \
	cases=$$(cat $$logs/cases); rest=$$(cat $$logs/rest); unit=$$(cat $$logs/unit); \
	grep -h -E "^(FAILED|ERROR) " $$logs/*.log | sed "s/^/make test: /"; rm -rf $$logs; \
	echo "make test: case batch exit $$cases, other functional tests $$rest, unit tests $$unit"; \
	test $$cases -eq 0 && test $$rest -eq 0 && test $$unit -eq 0

# The edit loop's tier: the unit tests but the slowest (tests/unit_tests/conftest.py, SLOW) and
# two 4-process launches (PACI with and without the bucketed overlap of the data-parallel
# reduction, equal bit for bit). `make test` runs everything.
QUICK_LAUNCH := tests/functional_tests/test_data_parallel_overlap_cases.py::test_overlap_gives_the_same_numbers_bit_for_bit[gpt_dp2pp2_paci_overlap-gpt_dp2pp2_paci]

test-quick: venv data
	$(PY) -m pytest -q -p no:cacheprovider -n 2 -m "not slow" tests/unit_tests
	FUNCTIONAL_CASES=gpt_dp2pp2_paci,gpt_dp2pp2_paci_overlap $(PY) -m pytest -q -p no:cacheprovider "$(QUICK_LAUNCH)"

# The Slurm launch test on a one-node cluster it starts on loopback. Installs Debian's Slurm and
# MUNGE first (needs root); there a missing package fails the test instead of skipping it.
cluster-test: venv data
	bash tools/install_slurm.sh
	PACI_REQUIRE_SLURM=1 $(PY) -m pytest -q -p no:cacheprovider tests/functional_tests/test_slurm.py

unit-test: venv data
	$(PY) -m pytest -q tests/unit_tests

functional-test: venv data
	$(PY) -m pytest -q tests/functional_tests

# Every command and snippet of README.md and the guides, run or checked (docs/tests.md); the
# cheap part runs in the suite (tests/unit_tests/test_docs.py).
docs-check: venv data data-small
	$(PY) tools/check_docs.py

lint: venv
	$(PY) -m black --check -l 100 megatron tools tests pretrain_gpt.py setup.py
	$(PY) -m isort --check --profile black -l 100 megatron tools tests pretrain_gpt.py setup.py

format: venv
	$(PY) -m black -q -l 100 megatron tools tests pretrain_gpt.py setup.py
	$(PY) -m isort -q --profile black -l 100 megatron tools tests pretrain_gpt.py setup.py

clean:
	rm -rf $(VENV) $(DATA) runs
