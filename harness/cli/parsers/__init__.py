"""The parser of each subcommand, one module per command: light modules that name their
command's implementation (:class:`harness.cli.arguments.Command`) rather than import it, so
that ``--help`` and a usage error load no command's module."""
