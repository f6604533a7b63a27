"""Internals of the data-kernel core (:mod:`blockflow.blockwise`, :mod:`blockflow.reduction`,
:mod:`blockflow.aggregations`): the kernel wrapper tasks run, moment merges, reduction
dtypes and the worker side of speculative copies. Nothing here is public API.
"""
