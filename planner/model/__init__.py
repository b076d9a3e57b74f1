"""The GLM-family transformer in torch (torch modules only; used by training, serving, Hugging Face
weight I/O and the profiler): glm.py (blocks, embeddings, output, loss), attention.py (mask,
rotary, ALiBi, eager and linear attention), norms.py, parallel/ (tensor, pipeline, groups)."""
