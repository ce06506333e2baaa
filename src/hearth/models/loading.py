"""Build a model from a checkpoint: the config picks the class, tensors load by name."""

from __future__ import annotations

import torch
from tqdm import tqdm

from hearth.checkpoint import Checkpoint
from hearth.config import parse_config
from hearth.errors import CheckpointError
from hearth.models.gemma import Gemma3Model


def build_model(
    checkpoint: Checkpoint,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> Gemma3Model:
    """The model of `checkpoint` in `dtype` on `device`; every parameter must come from the file."""
    config = parse_config(checkpoint.config)
    with torch.device("meta"):
        model = Gemma3Model(config)
    expected = dict(model.named_parameters())
    loaded: dict[str, torch.Tensor] = {}
    names = checkpoint.tensor_names()
    tensors = tqdm(
        checkpoint.tensors(),
        total=len(names),
        desc="Loading",
        unit="tensor",
        disable=None if progress else True,  # None: only on a terminal
        leave=False,
    )
    for name, tensor in tensors:
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        target = expected.get(name)
        if target is None:
            raise CheckpointError(f"{checkpoint.path}: unexpected tensor {name!r}")
        if tuple(tensor.shape) != tuple(target.shape):
            raise CheckpointError(
                f"{checkpoint.path}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"the config implies {tuple(target.shape)}"
            )
        loaded[name] = tensor.to(device=device, dtype=dtype)
    missing = sorted(set(expected) - set(loaded))
    if missing:
        raise CheckpointError(f"{checkpoint.path}: missing tensor {missing[0]!r}")
    model.load_state_dict(loaded, assign=True, strict=False)
    return model.to(device).eval()
