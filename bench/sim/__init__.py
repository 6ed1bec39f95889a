"""A trace-driven simulator of GPU job placement over a distributed cache (see engine.py)."""
