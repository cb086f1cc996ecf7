"""Model classes SGLang loads through ``SGLANG_EXTERNAL_MODEL_PACKAGE``, inside SGLang's processes.

SGLang imports every module here and registers its ``EntryClass`` over its own classes of
the same name; Strata sets the variable only for the servers whose draft feed it records
(``server.SGLangServer(feed_dir=...)``). This runs in SGLang's own environment, with this
repository on ``PYTHONPATH``: what it imports of Strata (``pipeline.engines.feed_files`` and the
package ``__init__`` files on the way) must need no more than that environment has -- torch,
safetensors, numpy, pydantic (``tests/test_sglang_server.py`` loads it there for real).
"""

FEED_DIR_ENV = "STRATA_SGLANG_FEED_DIR"  # where the recorder writes; set only for a recording server
