"""The bottom layer: user errors, registries, atomic writes, device settings, fault points,
metric names.

Imports nothing else of the harness.
"""
