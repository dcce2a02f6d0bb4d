"""Helpers the tests share (imported as `tests.helpers.*`); fixtures stay in tests/conftest.py."""
