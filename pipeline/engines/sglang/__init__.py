"""SGLang: the engine adapter (``engine``) over SGLang's own HTTP server started from its own
environment (``server``), and the recorder package that server loads (``models``)."""
