"""Draft models: the EAGLE drafter, the draft LM for classic speculative sampling, checkpoint formats."""
