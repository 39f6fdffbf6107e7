"""The toolkit's error types: every error a user can cause derives from ToolkitError."""


class ToolkitError(Exception):
    """Base class of every error the toolkit raises on bad input."""


class FormatError(ToolkitError, ValueError):
    """A tensor cannot be quantized or decoded in the requested format (shape, NaN, range)."""


class BackendError(ToolkitError, RuntimeError):
    """A requested backend is unknown or not available on this machine."""


class ModelError(ToolkitError, ValueError):
    """A model directory, checkpoint or configuration is malformed or unsupported."""
