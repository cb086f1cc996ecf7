"""Which hidden states was a draft trained on? Asked of the draft's own predictions.

A draft fed the layers it was trained on fits the target's next-token distribution best: that is
what its training optimised. ``capture`` runs the target once over probe conversations and keeps
every residual boundary r_0..r_N; ``score`` computes the draft's training loss (and its greedy
agreement) on the assistant tokens for one aux set; ``search`` ranks candidate sets and says how sure it is; ``job`` is the command.
"""
