"""Tokenizers by Megatron's --tokenizer-type names, and SentencePiece / GPT-2 BPE trainers."""
