#!/usr/bin/env python3
"""Quantize a GGUF with llama.cpp's own quantizer (llama-cpp-python's binding).

    python tools/llama_quantize.py IN.gguf OUT.gguf Q4_K_M

The files are those of real downloads: llama.cpp picks each tensor's type
(its "_M" mixes raise attn_v and ffn_down; widths that are not a multiple of
256 fall back to Q5_0 / Q5_1 / IQ4_NL / Q8_0). A quantized source is
requantized (allow_requantize). Output goes to OUT.part, renamed when complete.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path


def quantize(src: str | Path, dst: str | Path, ftype: str, threads: int = 2) -> Path:
    """Write src quantized to llama.cpp's file type `ftype` (Q4_K_M, Q6_K, IQ4_XS, ...) at dst."""
    import llama_cpp  # noqa: PLC0415 - the reference is an optional, test-time dependency

    code = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype.upper()}", None)
    if code is None:
        raise ValueError(f"llama.cpp has no file type {ftype!r}")
    dst = Path(dst)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = code
    params.allow_requantize = True
    params.nthread = threads
    part = dst.with_name(dst.name + ".part")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(part).encode(), ctypes.byref(params))
    if rc != 0:
        part.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp could not quantize {src} to {ftype} (return code {rc})")
    part.rename(dst)
    return dst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("ftype", help="llama.cpp file type: Q4_K_M, Q5_K_M, Q6_K, Q8_0, IQ4_XS, ...")
    args = ap.parse_args(argv)
    try:
        quantize(args.src, args.dst, args.ftype)
    except (ValueError, RuntimeError, ImportError) as exc:
        print(f"llama_quantize: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
