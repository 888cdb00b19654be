#!/usr/bin/env python3
"""Prompt encoding time, edgetp's tokenizer beside llama.cpp's on the same file and text.

    python tools/bench_tokenizer.py                      # stories260K and SmolLM2, 2,000 and 20,000 characters
    python tools/bench_tokenizer.py --models smollm2 --chars 2000,100000

A long prompt is tokenised before its first token can start, so encoding must stay well
under prefill's own time (the old unit test's bound: 100 ms for 2,000 characters). The text
is mixed English, digits, accents, CJK and an emoji. Each time is the best of ``--reps``
encodes, the word cache cleared before each (a new prompt, not a repeat). The ids of both
engines are compared; "same ids" must say yes. A second table times building the tokenizer
from the file, which every start pays: edgetp opens the GGUF as a start does (its header from
the index) and builds from its metadata; llama.cpp loads the vocabulary alone. Beside it, a
file's first open, before any index (`--models` also takes a path, such as a Llama 3 file with
its 128k vocabulary): edgetp's parse of the header and its index written, against gguf-py's
stock reader parsing the same header.

One run on a shared machine: read the figures as one sample.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from edgetp import store  # noqa: E402
from edgetp.model import gguf  # noqa: E402
from edgetp.model.tokenizer import Tokenizer  # noqa: E402
from tools import bench_local  # noqa: E402  (cpu_line: the CPU and flags a table is measured on)

LINE = "Once upon a time, in 1987, Ünal met 李雷 at café №9 — they said “don't panic!” 🙂\n"
MODELS = {"stories": ROOT.parent / "shared" / "models" / "stories260K.gguf", "smollm2": "smollm2"}


def best_of(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def first_open(path: Path) -> None:
    """A start that finds no index: the header parsed, its index written, the tensors mapped."""
    with tempfile.TemporaryDirectory(prefix="edgetp-bench-index-") as index:
        gguf.open_model(path, index)


def stock_parse(path: Path) -> None:
    from gguf import GGUFReader  # noqa: PLC0415

    reader = GGUFReader(path)
    for field in reader.fields.values():  # what an index keeps of each
        field.contents()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="stories,smollm2")
    ap.add_argument("--chars", default="2000,20000")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args(argv)
    import llama_cpp  # noqa: PLC0415  (the reference; installed by make)

    print(f"Prompt encoding on {bench_local.cpu_line()}, 1 thread, best of {args.reps}; llama-cpp-python "
          f"{llama_cpp.__version__}\n")
    print(f"| model | characters | edgetp ms | llama.cpp ms | ratio | same ids |\n|---|---:|---:|---:|---:|---|")
    loads = []
    for name in args.models.split(","):
        path = store.resolve(MODELS.get(name, name))
        build = lambda path=path: Tokenizer.from_metadata(gguf.open_model(path, store.cache_dir() / "index").metadata)  # noqa: E731
        load = lambda path=path: llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)  # noqa: E731
        tok, ref = build(), load()
        loads.append((name, tok.vocab_size, best_of(build, args.reps), best_of(load, args.reps),
                      best_of(lambda path=path: first_open(path), min(args.reps, 3)),
                      best_of(lambda path=path: stock_parse(path), min(args.reps, 3))))
        for n in (int(c) for c in args.chars.split(",")):
            text = (LINE * (n // len(LINE) + 1))[:n]

            def ours():
                tok._word_cache.clear()
                return tok.encode(text)

            def theirs():
                return ref.tokenize(text.encode(), add_bos=True)

            t_ours, t_ref = best_of(ours, args.reps), best_of(theirs, args.reps)
            same = "yes" if ours() == theirs() else "NO"
            print(f"| {name} | {n} | {t_ours * 1e3:.2f} | {t_ref * 1e3:.2f} | {t_ours / t_ref:.1f}× | {same} |")
    print("\n| model | vocabulary | edgetp build ms | llama.cpp vocab-only load ms | ratio | first open: edgetp ms "
          "| gguf-py's stock reader ms |\n|---|---:|---:|---:|---:|---:|---:|")
    for name, vocab, ours, theirs, first, stock in loads:
        print(f"| {name} | {vocab} | {ours * 1e3:.1f} | {theirs * 1e3:.1f} | {ours / theirs:.1f}× | {first * 1e3:.0f} "
              f"| {stock * 1e3:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
