"""The error every "this input cannot be used as given" derives from.

The CLI exits 2 on it (and on a bad config file), 1 on anything else: a config, target,
dataset, artifact or id list that needs changing is not a crash. Each subclass's message
names the input and what to change.
"""


class UnusableInput(ValueError):
    pass
