"""Which hidden states was a draft trained on? Asked of the draft's own predictions.

A draft fed the layers it was trained on predicts the target's next tokens; fed others, it
mostly does not. ``capture`` runs the target once over probe prompts and keeps every residual
boundary r_0..r_N; ``score`` counts the draft's agreement with the target's greedy tokens for
one aux set; ``search`` ranks candidate sets and says how sure it is; ``job`` is the command.
"""
