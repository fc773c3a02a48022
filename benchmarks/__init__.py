"""radixrt benchmarks: multi-call workloads, an in-process and an HTTP runner, the HF
baseline. Run from the repository root, e.g. `python -m benchmarks.bench_serving --help`."""
