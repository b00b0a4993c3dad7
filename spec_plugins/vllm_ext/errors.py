"""The one error a tree setting vLLM cannot serve raises (at startup), shared by
the config checks (``config``, ``runner_choice``) without an import circle."""


class TreeConfigError(ValueError):
    """A tree setting vLLM cannot serve; the message names the option."""
