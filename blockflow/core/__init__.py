"""Internals of the data-kernel core: kernel wrapper, moments, reduction dtypes, speculation."""
