"""FormatError: a file on disk is corrupt or inconsistent with the format it claims."""


class FormatError(ValueError):
    """Raised for any corrupt or inconsistent checkpoint file; the message names the file."""
