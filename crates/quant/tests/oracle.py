#!/usr/bin/env python3
"""The dequantization oracle: the `gguf` package's numpy dequantizers (an implementation
scoria did not write) against scoria's, bit for bit. Driven by `oracle.rs`:

  oracle.py check DIR   for every DIR/<TYPE>.blocks (raw blocks) and DIR/<TYPE>.f32 (scoria's
                        dequantization, little-endian f32), dequantize the blocks with
                        gguf.quants.dequantize and compare every value's bits; exit 1 on
                        any difference, naming the type, block and value.
  oracle.py make DIR    for every type the package can quantize, write random values
                        quantized by the package (DIR/<TYPE>.ref-blocks) and the package's
                        dequantization of them (DIR/<TYPE>.ref-f32), for scoria to read.
"""
import pathlib
import sys

import numpy as np
from gguf import GGMLQuantizationType, quants
from gguf.constants import GGML_QUANT_SIZES


def check(d: pathlib.Path) -> int:
    bad = 0
    n_types = 0
    for blocks_path in sorted(d.glob("*.blocks")):
        name = blocks_path.stem
        qtype = GGMLQuantizationType[name]
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        raw = np.frombuffer(blocks_path.read_bytes(), dtype=np.uint8)
        ours = np.frombuffer((d / f"{name}.f32").read_bytes(), dtype="<f4")
        n_blocks = raw.size // type_size
        theirs = quants.dequantize(raw.reshape((n_blocks, type_size)), qtype).reshape(-1)
        theirs = theirs.astype(np.float32)
        if theirs.size != ours.size:
            print(f"{name}: {theirs.size} values from gguf, {ours.size} from scoria")
            bad += 1
            continue
        diff = np.nonzero(theirs.view(np.uint32) != ours.view(np.uint32))[0]
        if diff.size:
            i = int(diff[0])
            print(
                f"{name}: {diff.size} of {ours.size} values differ; first: block {i // block_size} "
                f"value {i % block_size}: gguf {theirs[i]!r} scoria {ours[i]!r}"
            )
            bad += 1
        n_types += 1
    print(f"oracle: {n_types} types checked, {bad} with differences")
    return 1 if bad or n_types == 0 else 0


def make(d: pathlib.Path) -> int:
    rng = np.random.default_rng(20)
    made = []
    for name in sys.argv[3:]:
        qtype = GGMLQuantizationType[name]
        block_size, _ = GGML_QUANT_SIZES[qtype]
        x = rng.uniform(-2.0, 2.0, size=(16, 8 * 256)).astype(np.float32)
        x[0, :block_size] = 0.0  # an all-zero block
        try:
            q = quants.quantize(x, qtype)
        except NotImplementedError:
            continue
        (d / f"{name}.ref-blocks").write_bytes(np.ascontiguousarray(q).tobytes())
        y = quants.dequantize(q, qtype).astype("<f4")
        (d / f"{name}.ref-f32").write_bytes(y.tobytes())
        made.append(name)
    print(f"oracle: quantized with gguf: {' '.join(made)}")
    return 0


if __name__ == "__main__":
    mode, where = sys.argv[1], pathlib.Path(sys.argv[2])
    sys.exit(check(where) if mode == "check" else make(where))
