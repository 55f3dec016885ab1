"""Building blocks a method or the engine assembles: datasets and sampling, backbones,
metric losses, retrieval metrics, explanation maps, optimal transport.

Imports only :mod:`harness.base`.
"""
