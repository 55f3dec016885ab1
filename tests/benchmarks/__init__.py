"""The benchmark scripts of ``benchmarks/``, run on tiny inputs."""
