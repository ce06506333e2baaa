"""bf16 parity on a GPU: Hearth and HF transformers on the same tiny random checkpoints.

For the tiny Gemma 3 config and each tiny Gemma 4 config of tests/models/test_gemma4.py, both run in
bf16 on the GPU (Hearth: cached prefill + decode steps; HF: one full forward) and are compared
with an fp32 CPU reference. bf16 rounds every op, so neither matches fp32 exactly; the check
is that Hearth's error stays in the same range as HF's (ratio column) and small against the
logit range. Writes a markdown table.

    python benchmarks/gpu_parity.py --out table.md
    python benchmarks/gpu_parity.py --prompt 96   # a prefill long enough for grouped experts
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from hearth.checkpoint import open_checkpoint
from hearth.kv import make_caches
from hearth.models.loading import build_model
from test_gemma4 import CONFIGS
from tiny import save_hf, tiny_gemma3_model, tiny_gemma4_model

PROMPT, DECODE_STEPS = 24, 10


@torch.inference_mode()
def cached_logits(model: Any, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    caches = make_caches(model.cache_specs())
    pieces = [model(ids[:, :prompt], caches)]
    for position in range(prompt, ids.shape[1]):
        pieces.append(model(ids[:, position : position + 1], caches, start=position))
    return torch.cat(pieces, dim=1).float().cpu()


def compare(name: str, hf: Any, directory: Path, device: torch.device, prompt: int) -> str:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(4, hf.config.vocab_size, (1, prompt + DECODE_STEPS), generator=generator)
    with torch.inference_mode():
        reference = hf(input_ids=ids).logits.float()
        hf_bf16 = hf.to(device, torch.bfloat16)(input_ids=ids.to(device)).logits.float().cpu()
    ours = cached_logits(
        build_model(open_checkpoint(directory), torch.bfloat16, device, progress=False),
        ids.to(device),
        prompt,
    )
    scale = reference.abs().max().item()
    ours_error = (ours - reference).abs().max().item()
    hf_error = (hf_bf16 - reference).abs().max().item()
    return (
        f"| {name} | {scale:.2f} | {ours_error:.4f} | {hf_error:.4f} | "
        f"{ours_error / hf_error:.2f} | {ours_error / scale:.2%} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out")
    parser.add_argument(
        "--prompt", type=int, default=PROMPT, help="prefill tokens before the decode steps"
    )
    args = parser.parse_args()
    device = torch.device("cuda")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        builders = {"gemma3": lambda: tiny_gemma3_model(seed=3)}
        for index, (name, overrides) in enumerate(CONFIGS.items()):
            builders[f"gemma4 {name}"] = lambda i=index, o=overrides: tiny_gemma4_model(i, **o)
        for name, build in builders.items():
            hf = build()
            directory = save_hf(hf, Path(folder) / name.replace(" ", "_"))
            rows.append(compare(name, hf, directory, device, args.prompt))
            print(rows[-1], flush=True)
    import transformers

    table = (
        "\n".join(
            [
                f"# bf16 parity on GPU — {datetime.date.today()}",
                "",
                f"{torch.cuda.get_device_name()}, torch {torch.__version__}, transformers "
                f"{transformers.__version__}. Max |logit error| against the fp32 CPU reference "
                f"over {args.prompt + DECODE_STEPS} positions (Hearth: {args.prompt}-token "
                f"prefill, then {DECODE_STEPS} cached decode steps).",
                "",
                "| config | max abs logit | Hearth bf16 error | HF bf16 error | ratio "
                "| Hearth error / range |",
                "|---|---|---|---|---|---|",
                *rows,
            ]
        )
        + "\n"
    )
    print(table)
    if args.out:
        Path(args.out).write_text(table)


if __name__ == "__main__":
    main()
