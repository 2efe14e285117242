"""Timing one setting safely: the timing loop, its supervision, memory and deadlines."""
