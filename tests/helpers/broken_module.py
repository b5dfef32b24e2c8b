"""A module of a user's own that raises while it is imported (tests/test_errors.py)."""

raise RuntimeError("a bug at the top of the module")
