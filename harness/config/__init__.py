"""Protocols (settings as data, fingerprinted) and grids (axes of runs). Names are
validated against the registries of methods, losses, datasets and backbones, so this layer
sits above :mod:`methods`."""
