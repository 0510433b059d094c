"""Training data: indexed-dataset checks and iterators, jsonl preprocessing, the default corpus."""
