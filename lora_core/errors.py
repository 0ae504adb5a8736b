"""The error types of lora_core, below every module that raises them."""


class AdapterError(ValueError):
    """An adapter that cannot be loaded (the message names the file, the field or tensor, what was
    expected and what was received) or placed into a model (the module and the shapes)."""
