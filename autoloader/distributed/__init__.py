"""Tuning every rank of a torchrun job together."""
