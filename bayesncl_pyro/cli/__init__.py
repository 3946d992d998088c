"""The command-line programs behind experiments/*.py: each module's ``main(argv=None) -> int`` parses ``argv`` and
returns the exit status, so the scripts are a few lines and tests call ``main`` in-process."""
