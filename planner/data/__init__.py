"""Training data, numpy only (no torch: the search and the ladder use it to choose loader settings
and count padding): sources.py, text.py, indexed.py (corpora: token files, raw text with a
tokenizer, Megatron indexed datasets), corpus.py (DataSpec, the synthetic and the user's corpus,
the held-out split), batching.py (static and packed rows, which rows a rank reads), loader.py
(micro-batches and the loader settings), prepare.py (`planner prepare-data`). The torch
DataLoader over them is planner/runtime/train/build.py."""
