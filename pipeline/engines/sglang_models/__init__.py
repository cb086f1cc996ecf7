"""Model classes SGLang loads through ``SGLANG_EXTERNAL_MODEL_PACKAGE`` (GPU clusters only).

SGLang imports every module here and registers its ``EntryClass`` over its own classes of
the same name; Strata sets the variable only for the validation engine that records the
draft's feed (``sglang_engine.serve_eagle3(record_feed=True)``).
"""

FEED_DIR_ENV = "STRATA_SGLANG_FEED_DIR"  # where the recorder writes; set only for a validation engine
