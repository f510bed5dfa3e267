"""Helpers for tests and examples: tiny random models and checkpoints."""
