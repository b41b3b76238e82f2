"""The one exception type for bad input."""


class ConfigError(ValueError):
    """Bad input, found before any work starts.

    Attributes:
        field: the name of the offending setting; it is also the CLI flag's name.
        value: the value that was given.
        reason: what is wrong with it, as a sentence fragment.
    """

    def __init__(self, field: str, value, reason: str):
        self.field = field
        self.value = value
        self.reason = reason
        super().__init__(f"{field}={value!r}: {reason}")


class DataError(RuntimeError):
    """The training data failed while training (a generator that raised, a corrupt file,
    a stream that ended early): one line naming the data and the step; the last
    checkpoint stands."""
