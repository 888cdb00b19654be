#!/usr/bin/env python3
"""Re-quantize the weights of an existing GGUF model to Q8_0, Q4_0 or Q4_1.

Every 2-D weight stored in a quantized type is dequantized with
gguf.quants.dequantize and quantized again with gguf.quants.quantize to the
target type.  1-D tensors (norms) are copied unchanged, and so is
token_embd.weight unless --all is given.  Float 2-D weights (F32/F16/BF16)
are copied unchanged unless --include-float is given.  Tensors whose input
width is not a multiple of the target block size are copied unchanged (and
reported).  All metadata is copied byte for byte (arrays included: tokens,
merges, token types, chat template) except general.file_type, which is set
for the target.  Output goes to OUT.part and is renamed when complete.

    python tools/requant_gguf.py IN.gguf OUT.gguf --type q8_0
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

import gguf

from edgetp.model.gguf import gguf_writer
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT
from gguf import LlamaFileType

TARGETS: dict[str, tuple[QT, LlamaFileType]] = {
    "q8_0": (QT.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "q4_0": (QT.Q4_0, LlamaFileType.MOSTLY_Q4_0),
    "q4_1": (QT.Q4_1, LlamaFileType.MOSTLY_Q4_1),
    # Plain dequantization: the exact weight values in f32, so that llama.cpp computes
    # f32 dot products too (it rounds activations to 8 bits against quantized weights).
    "f32": (QT.F32, LlamaFileType.ALL_F32),
}

FLOAT_TYPES = (QT.F32, QT.F16, QT.BF16, QT.F64)


@dataclass
class RequantReport:
    path: Path
    requantized: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # name -> reason it could not be converted
    seconds: float = 0.0


def _field_value(f: gguf.ReaderField) -> tuple[Any, VT, VT | None]:
    """(value, type, sub_type) of a reader field, with strings as raw bytes so they copy exactly."""
    main = f.types[0]
    if main == VT.ARRAY:
        sub = f.types[-1]
        if len(f.types) != 2:
            raise ValueError(f"{f.name}: nested arrays are not supported")
        if sub == VT.STRING:
            return [bytes(f.parts[i]) for i in f.data], main, sub
        return f.contents(), main, sub
    if main == VT.STRING:
        return bytes(f.parts[-1]), main, None
    return f.contents(), main, None


def copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter, overrides: dict[str, tuple[Any, VT]]) -> None:
    """Copy every key/value except the virtual GGUF.* fields and general.architecture
    (GGUFWriter writes that itself); `overrides` replaces values by key."""
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name == gguf.Keys.General.ARCHITECTURE:
            continue
        if f.name in overrides:
            val, vtype = overrides[f.name]
            writer.add_key_value(f.name, val, vtype)
            continue
        val, vtype, sub = _field_value(f)
        if vtype == VT.ARRAY and len(val) == 0:
            # GGUFWriter refuses empty arrays; nothing we can do but drop them
            continue
        writer.add_key_value(f.name, val, vtype, sub_type=sub)
    for key, (val, vtype) in overrides.items():
        if key not in reader.fields:
            writer.add_key_value(key, val, vtype)


def requantize_tensor(data: np.ndarray, src: QT, dst: QT) -> np.ndarray:
    """Dequantize a stored tensor (reader layout) and quantize it to `dst` (uint8 rows)."""
    return gguf.quants.quantize(gguf.quants.dequantize(data, src), dst)


def requant(src: str | os.PathLike[str], dst: str | os.PathLike[str], target: str = "q8_0", *,
            all_tensors: bool = False, include_float: bool = False,
            progress: Callable[[str], None] | None = None) -> RequantReport:
    """Write a copy of GGUF `src` to `dst` with its quantized 2-D weights re-quantized to `target`."""
    t0 = time.perf_counter()
    key = target.lower()
    if key not in TARGETS:
        raise ValueError(f"unknown target {target!r}; choose from {', '.join(TARGETS)}")
    qdst, ftype = TARGETS[key]
    block, type_size = gguf.GGML_QUANT_SIZES[qdst]
    src, dst = Path(src), Path(dst)
    reader = gguf.GGUFReader(src)
    arch_field = reader.fields.get(gguf.Keys.General.ARCHITECTURE)
    if arch_field is None:
        raise ValueError(f"{src}: no general.architecture")
    arch = arch_field.contents()

    report = RequantReport(path=dst)
    plan: list[tuple[Any, bool]] = []  # (reader tensor, convert?)
    for t in reader.tensors:
        convert = False
        n_dims = len(t.shape)
        if n_dims >= 2 and t.tensor_type != qdst:
            is_float = t.tensor_type in FLOAT_TYPES
            wanted = (not is_float) or include_float
            if t.name == "token_embd.weight" and not all_tensors:
                wanted = False
            if wanted:
                cols = int(t.shape[0])
                if cols % block:
                    report.skipped[t.name] = f"input width {cols} is not a multiple of {block}"
                else:
                    convert = True
        plan.append((t, convert))

    with gguf_writer(dst, arch) as writer:
        align = reader.fields.get(gguf.Keys.General.ALIGNMENT)
        if align is not None:
            writer.data_alignment = int(align.contents())
        copy_metadata(reader, writer, {gguf.Keys.General.FILE_TYPE: (int(ftype), VT.UINT32)})
        for t, convert in plan:
            if convert:
                n_rows = int(t.n_elements) // int(t.shape[0])
                row_bytes = int(t.shape[0]) // block * type_size
                shape = [*(int(x) for x in reversed(t.shape[1:].tolist())), row_bytes]
                assert int(np.prod(shape[:-1])) == n_rows
                if qdst == QT.F32:
                    shape = [*(int(x) for x in reversed(t.shape.tolist()))]
                    writer.add_tensor_info(t.name, shape, np.dtype(np.float32), n_rows * int(t.shape[0]) * 4)
                else:
                    writer.add_tensor_info(t.name, shape, np.dtype(np.uint8), n_rows * row_bytes, raw_dtype=qdst)
            else:
                writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, raw_dtype=t.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t, convert in plan:
            if convert:
                data = requantize_tensor(np.asarray(t.data), t.tensor_type, qdst)
                report.requantized.append(t.name)
            else:
                data = t.data
                report.kept.append(t.name)
            writer.write_tensor_data(data, tensor_endianess=reader.endianess)
            if progress is not None:
                progress(t.name)
    report.seconds = time.perf_counter() - t0
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Re-quantize a GGUF model's quantized 2-D weights to another type.")
    ap.add_argument("src", help="input .gguf")
    ap.add_argument("dst", help="output .gguf (written to DST.part, then renamed)")
    ap.add_argument("--type", dest="target", default="q8_0", choices=list(TARGETS))
    ap.add_argument("--all", dest="all_tensors", action="store_true",
                    help="also re-quantize token_embd.weight (kept in its type by default)")
    ap.add_argument("--include-float", action="store_true",
                    help="also quantize 2-D weights stored as F32/F16/BF16")
    ap.add_argument("-q", "--quiet", action="store_true")
    args = ap.parse_args(argv)
    try:
        rep = requant(args.src, args.dst, args.target, all_tensors=args.all_tensors,
                      include_float=args.include_float)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not args.quiet:
        size = rep.path.stat().st_size
        print(f"wrote {rep.path} ({size / 1e6:.1f} MB) in {rep.seconds:.1f} s: "
              f"{len(rep.requantized)} tensors re-quantized to {args.target.upper()}, {len(rep.kept)} copied")
        for name, why in rep.skipped.items():
            print(f"  kept {name}: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
