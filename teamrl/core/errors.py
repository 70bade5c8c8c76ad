"""The errors of bad input: one line naming the input and what is accepted (``teamrl`` prints it and exits 2)."""

from __future__ import annotations


class InputError(ValueError):
    """Bad input from the user: a config, a data file, a model name, or what a task's code returned.

    The message is one line that names the input and what would be accepted; ``teamrl`` prints it
    and exits with code 2. Any other exception is a bug and keeps its traceback.
    """


class ConfigError(InputError):
    """A config key or value is not allowed; the message names the key and what is."""


class InputFileMissing(InputError, FileNotFoundError):
    """A file or folder that the input names does not exist (also a ``FileNotFoundError``)."""
