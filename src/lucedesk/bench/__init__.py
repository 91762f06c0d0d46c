"""Benchmarks: the in-process engine (offline) and any OpenAI-compatible server."""
