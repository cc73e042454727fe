"""The project's version, in one place: ``--version`` of every script prints it."""

__version__ = "0.6.0"
