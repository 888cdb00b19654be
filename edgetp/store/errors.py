"""Errors of the model store: each str() is one line naming the file or URL."""


class StoreError(Exception):
    """A model could not be found, fetched or verified; str(err) is one line for the user."""


class ModelNotFound(StoreError):
    """resolve() found no file for the name it was given."""


class DownloadError(StoreError):
    """The server or pip refused, or could not be reached."""


class DownloadInterrupted(DownloadError):
    """The transfer stopped part way (connection drop, Ctrl-C); the .part file is kept."""


class VerifyError(StoreError):
    """The bytes are wrong (size, sha256, not GGUF); the .part file is deleted."""
