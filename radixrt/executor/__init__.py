"""The executor: runs a StepPlan on the device (ModelRunner, CUDA graphs, sampling, per-slot
state, the draft model, tensor-parallel ranks). The driver that plans steps is radixrt.engine."""
