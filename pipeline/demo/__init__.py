"""The embedded default: a tiny target built and pretrained locally (``tiny``, ``pretrain``),
conversations from the Python standard library, and ``strata demo``'s story (``story``), so
the whole pipeline runs on a fresh machine with nothing downloaded."""
