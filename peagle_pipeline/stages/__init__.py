"""Orchestration: the only layer that wires I/O, models and loops (extract, train, export, ...)."""
