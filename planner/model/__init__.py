"""The GLM-family transformer in torch (torch modules only; used by training, serving, Hugging Face
weight I/O and the profiler): glm.py (GLMModel, the whole layer list), block.py (SelfAttention,
MLP, Block), embedding.py, head.py (final norm, output layer, loss), recompute.py (activation
checkpointing, what a layer keeps for backward), attention.py (mask, rotary, ALiBi, eager and
linear attention), norms.py, moe.py, kvcache.py, parallel/ (tensor, pipeline, groups)."""
