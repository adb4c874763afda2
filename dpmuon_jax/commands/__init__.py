"""The ``dpmuon`` subcommands that are not a single training run: ``account``, ``tune``,
``compare`` (each a parser-adding ``add`` and a ``run`` of the parsed arguments)."""
