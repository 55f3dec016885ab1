"""The bottom layer: user errors, registries, atomic writes, device settings, fault points.

Imports nothing else of the harness.
"""
