"""Shared fixtures: where the real models are, and the llama.cpp reference.

Models come from ../shared/models (stories260K), from the model cache that
`edgetp model pull smollm2` fills (the Makefile runs it before the suite),
or from tools/synth_gguf.py. The suite itself never downloads anything.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
from hypothesis import settings

import edgetp.model  # noqa: F401  numba's cache folder for this source (jitcache), inherited by every child

REPO = Path(__file__).resolve().parent.parent
# Daemons the tests start split every layer over their nodes (tensor parallelism), as the tests of
# that machinery expect; the planner's own choice ("auto", the product's default) is tested where it
# is named: test_pipeline, test_cost, test_rebalance.
os.environ.setdefault("EDGETP_PARALLEL", "tp")
# Property tests draw the same examples on every run (a CI failure can be rerun and read); set
# HYPOTHESIS_PROFILE=explore to draw fresh ones and hunt for new failures. No deadline: tests are
# not timed on these shared machines, and a deadline would not stop a hang anyway. (A discovery
# property test failed once while a second test run shared the 2 cores and passed alone and on
# rerun; hypothesis's 200 ms per example was the only timing in it.)
settings.register_profile("ci", derandomize=True, print_blob=True, deadline=None)
settings.register_profile("explore", derandomize=False, print_blob=True, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
SHARED_MODELS = REPO.parent / "shared" / "models"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    if os.environ.get("EDGETP_CACHE_DIR"):
        return Path(os.environ["EDGETP_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "edgetp"


@pytest.fixture(scope="session")
def stories_path() -> Path:
    path = SHARED_MODELS / "stories260K.gguf"
    if not path.exists():
        pytest.fail(f"{path} is missing: the shared test model must sit beside the repo")
    return path


@pytest.fixture(scope="session")
def stories(stories_path):
    """stories260K opened, and its tokenizer: (ModelFile, Tokenizer), its kernels compiled.

    On a cold numba cache (a fresh clone, or any change to the kernels' source) the first
    generation compiles the kernels: 60 s on the 2-core AMD EPYC VM here, where the servers
    tests start here give a request 60 s. The daemon's own warm-up (generate.warm) here, before
    any test, puts that cost in the session's setup, whichever test comes first, and in numba's
    cache for every daemon the tests start."""
    from edgetp.model import gguf  # noqa: PLC0415
    from edgetp.model.generate import warm  # noqa: PLC0415
    from edgetp.model.tokenizer import Tokenizer  # noqa: PLC0415

    mf = gguf.open_model(stories_path)
    tok = Tokenizer.from_metadata(mf.metadata)
    warm(mf, tok)
    return mf, tok


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    path = cache_dir() / "models" / SMOLLM2_FILE
    if not path.exists():
        pytest.fail(f"{path} is missing: run `edgetp model pull smollm2` (make test does)")
    return path


@pytest.fixture(scope="session")
def llama_cpp():
    """The llama-cpp-python module, or a loud skip when it cannot be imported."""
    try:
        import llama_cpp  # noqa: PLC0415
    except ImportError as exc:  # pragma: no cover - depends on the machine
        reason = f"LLAMA.CPP REFERENCE MISSING: llama-cpp-python cannot be imported ({exc}); reference tests skipped"
        warnings.warn(reason, stacklevel=1)
        pytest.skip(reason)
    return llama_cpp


# tools/ holds the synthetic model writer and the requantizer; tests use them as modules.
import sys  # noqa: E402

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """A per-session folder for models the tests write (synthetic, requantized)."""
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def synth_model(model_dir):
    """Factory: synth_model(preset, weight_type, **overrides) -> path, written once per session."""
    from tools import synth_gguf  # noqa: PLC0415

    made: dict[tuple, Path] = {}

    def make(preset: str, weight_type: str = "f32", **overrides) -> Path:
        key = (preset, weight_type, tuple(sorted(overrides.items())))
        if key not in made:
            name = "-".join([preset, weight_type] + [f"{k}{v}" for k, v in sorted(overrides.items())])
            made[key] = synth_gguf.write_preset(model_dir / f"{name}.gguf", preset, weight_type=weight_type, **overrides)
        return made[key]

    return make


def require_int8_prefill() -> None:
    """Skip, loudly, where the integer prefill kernels do not run: every ISA has them
    (intgemm.py), so only EDGETP_INT8=0 (or an ISA this CPU lacks) leaves prefill on f32
    tiles. Where they can run, a failed probe is a failure, not a reason to skip."""
    from edgetp.model import intgemm, vnni  # noqa: PLC0415

    if not vnni.wanted():
        pytest.skip("INT8 PREFILL NOT RUN: EDGETP_INT8=0 (or EDGETP_ISA names an ISA this CPU lacks)")
    assert intgemm.available(), "the int8 prefill kernels failed their probe"


@pytest.fixture
def int8_prefill() -> None:
    require_int8_prefill()


@pytest.fixture(params=["float", "int8"])
def int8_kernels(request, monkeypatch) -> str:
    """Run a test once per kernel path, as a user chooses them:
    "float" (EDGETP_INT8=0): f32 activations everywhere, exact against the dequantized weights;
    "int8": quantized weights decode on the integer kernels of the ISA in use (every CPU has
    them: activations rounded to Q8_0 blocks as llama.cpp rounds them) and prefill
    on the integer panels of that ISA (Q4_0 int8, Q4_1/Q8_0 16-bit)."""
    from edgetp.model import intdot  # noqa: PLC0415

    if request.param == "float":
        monkeypatch.setenv("EDGETP_INT8", "0")
    else:
        monkeypatch.delenv("EDGETP_INT8", raising=False)
        broken = sorted(k for k in intdot.KINDS if not intdot.available(k))
        assert not broken, f"integer decode kernels failed their probe for types {broken}"
    return request.param


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """The compute thread count, 1 and then 2 (skipped where numba runs fewer)."""
    import numba  # noqa: PLC0415

    from edgetp.model import quant  # noqa: PLC0415

    if request.param > numba.config.NUMBA_NUM_THREADS:
        pytest.skip(f"needs {request.param} cores, this machine runs {numba.config.NUMBA_NUM_THREADS} threads")
    quant.set_threads(request.param)
    yield request.param
    quant.set_threads(None)


@pytest.fixture(params=["1", "0"], ids=["int8", "float"])
def int8(request, monkeypatch):
    """The integer decode kernels (EDGETP_INT8=1), then the float ones."""
    monkeypatch.setenv("EDGETP_INT8", request.param)
    return request.param == "1"


@pytest.fixture(params=["f16", "f32", "q8_0"])
def kv_type(request):
    """Each KV cache type (q8_0 needs a head size that is a multiple of 32)."""
    return request.param


@pytest.fixture(scope="module")
def float_workers():
    """Three real `edgetp worker` processes on 127.0.0.1 running the float kernels (EDGETP_INT8=0): the
    exact mode in which every plan must give the single node's tokens. Their addresses."""
    from edgetp.serve.spawn import start_worker, stop  # noqa: PLC0415

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("EDGETP_INT8", "0")
        procs = [start_worker() for _ in range(3)]
    try:
        yield [addr for _, addr in procs]
    finally:
        for proc, _ in procs:
            stop(proc)
