"""vLLM: the engine adapter (``engine``), the capture connector vLLM loads by module path
(``connector``) and the worker extension that records what the draft is fed (``feed``)."""
