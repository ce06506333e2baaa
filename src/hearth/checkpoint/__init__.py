"""Checkpoint readers: each yields a config and tensors under Hearth's canonical names.

Canonical names are the HF transformers names of the text decoder without the `model.` prefix
(`embed_tokens.weight`, `layers.3.self_attn.q_proj.weight`, `norm.weight`), with HF's meaning
for every value (Gemma 3 norm weights hold w, not 1 + w).
"""

from hearth.checkpoint.loader import Checkpoint, open_checkpoint

__all__ = ["Checkpoint", "open_checkpoint"]
