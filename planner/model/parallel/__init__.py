"""The executor's parallelism, one file per axis (picotron's layout):

- groups.py   process groups of the plan's rank layout and the mpu DeepSpeed asks;
- tensor.py   Megatron-style tensor parallelism (column/row-parallel linears, vocab-parallel
              embedding and cross-entropy, sequence parallelism) and its seeded initialisation;
- pipeline.py the PipelineModule cut at the plan's stage boundaries (tied embeddings, loss).

Data parallelism and ZeRO are DeepSpeed's own (the engine, given the groups built here).
"""
