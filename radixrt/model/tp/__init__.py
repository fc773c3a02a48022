"""Tensor parallelism, the model's side (which part of each weight a rank holds is
`radixrt.tp_shard`, torch-free, below the LoRA layer that slices adapters the same way): the
process groups and collectives (`group`), and the row-parallel linear and
vocabulary-parallel embedding / lm_head layers (`layers`). The executor that drives the ranks
is `radixrt.executor.tp`."""
