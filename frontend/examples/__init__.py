"""Runnable DSL examples (tiny model on CPU by default; `--url` to use a server)."""
