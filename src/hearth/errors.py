"""The errors Hearth raises for bad input: each carries one readable line for the user."""


class HearthError(Exception):
    """Base class: a problem with what the user gave (a path, a file, an option)."""


class CheckpointError(HearthError):
    """A model path that is missing, unreadable, corrupt, or of an unsupported kind."""


class UnsupportedModelError(CheckpointError):
    """A checkpoint of an architecture or format Hearth does not run."""
