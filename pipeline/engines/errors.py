"""Errors shared by the serving-engine adapters (vLLM, SGLang)."""


class EngineUnavailable(RuntimeError):
    """The engine's package (or the hardware it needs) is not available here."""


class EngineError(RuntimeError):
    """The engine ran but returned something Strata cannot trust."""
