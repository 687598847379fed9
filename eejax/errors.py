"""Errors that eejax raises for bad input: each carries a one-line message for the user.

The CLI prints `eejax: error: <message>` and exits with status 2 for any of them.
"""


class EejaxError(Exception):
    """A problem with what the user asked for (bad path, bad option, too long a prompt...)."""


class UnsupportedModelError(EejaxError):
    """The checkpoint's architecture or one of its settings is not implemented."""


class OutOfPagesError(EejaxError):
    """The page allocator cannot hand out the pages asked for.

    Attributes: `requested` and `available` page counts, so that a caller can wait, preempt or
    split its batch instead of failing.
    """

    def __init__(self, requested: int, available: int):
        super().__init__(f"KV cache out of pages: asked for {requested}, {available} free")
        self.requested = requested
        self.available = available
