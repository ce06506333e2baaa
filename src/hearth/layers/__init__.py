"""Building blocks of the models: linear kinds, norms, RoPE, attention, MLP, experts."""
