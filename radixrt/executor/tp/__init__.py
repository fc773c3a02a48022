"""Tensor parallelism, the executor: rank 0 (the engine's process) runs the scheduler and its
shard; ranks 1..tp-1 are worker processes the engine starts, which receive every step plan and
run the same forward on their shards. The TP layers and process groups are `radixrt.model.tp`.

- `plan_codec`: step plans as bytes
- `workers`: starting, watching and stopping the worker processes (rank 0)
- `worker`: a worker process's main loop
- `runner`: `TensorParallelRunner`, the Runner rank 0's EngineCore drives
"""
