"""Reproductions of the papers' tables on this simulator (``python -m bench.sim``)."""
