"""Reading and preparing training corpora: text, JSON lines, Megatron indexed datasets, tokenizers."""
