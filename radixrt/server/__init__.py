"""The HTTP server: a front process (HTTP API, tokenizer, detokenizer) and a scheduler
process (EngineCore) connected by ZeroMQ. Start it with `radixrt serve` (see launch.py)."""
