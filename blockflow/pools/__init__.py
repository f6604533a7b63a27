"""Pools: named groups of workers with a provider and a price, and the plans made over them.

Public names are re-exported from :mod:`blockflow`. Guide: :doc:`/guide/pools`.
"""
