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


class DoesNotFit(ConfigError):
    """The data does not fit the model: Keras' own error, in one line. `tfdp.fit` raises
    Keras' error itself (`keras_error`), as `model.fit` raises it."""

    def __init__(self, field: str, value, keras_error: BaseException):
        self.keras_error = keras_error
        text = str(keras_error).strip().splitlines()
        line = f"{type(keras_error).__name__}: {text[0] if text else ''}"[:300]
        super().__init__(field, value, f"does not fit the model ({line})")


class DataError(RuntimeError):
    """The training data failed while training (a generator that raised, a corrupt file,
    a stream that ended early): one line naming the data and the step; the last
    checkpoint stands."""
