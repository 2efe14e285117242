"""A module for ``tests/test_lazy.py`` to import lazily."""

VALUE = 7
