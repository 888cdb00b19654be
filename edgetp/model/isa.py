"""Which instruction set the integer kernels are compiled for, chosen once per process.

ISAs, best first on each architecture:
  avx512vnni  x86-64 with AVX-512 F/BW/VL and VNNI (Ice Lake, Zen 4)
  avxvnni     x86-64 with AVX2 and VEX-encoded VNNI (Alder Lake and later)
  avx2        x86-64 with AVX2, FMA and F16C (Haswell and later, Zen, Intel N100)
  neon        aarch64 with the dot-product extension (Cortex-A76: Raspberry Pi 5)
  generic     anything else; plain code that LLVM compiles for the baseline CPU

The best ISA the CPU has is used unless EDGETP_ISA names another. An ISA is
also numba's compile target: a narrower ISA than the CPU's best compiles every
kernel for a named CPU that has just those features (NUMBA_CPU_NAME, numba's
documented variable), so `EDGETP_ISA=avx2` on an AVX-512 machine runs the code
an N100 would run, and numba's on-disk cache keeps each target apart. A
NUMBA_CPU_NAME set by the user wins; the ISA is then read off that CPU name.

The choice must be made before numba compiles anything (numba reads its target
once), which is why `configure()` runs when `edgetp.model.quant` is imported.
A forced ISA this CPU lacks is an `IsaError` from `require()`, raised before
any kernel runs: the CLI prints it as one line instead of dying on SIGILL.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger(__name__)

ISAS = ("avx512vnni", "avxvnni", "avx2", "neon", "generic")
_ARCH = {"avx512vnni": "x86_64", "avxvnni": "x86_64", "avx2": "x86_64", "neon": "aarch64"}
# the CPU features (LLVM's names) an ISA needs
_NEEDS = {
    "avx512vnni": ("avx512f", "avx512bw", "avx512vl", "avx512vnni", "fma", "f16c"),
    "avxvnni": ("avxvnni", "avx2", "fma", "f16c"),
    "avx2": ("avx2", "fma", "f16c"),
    "neon": ("dotprod",),
    "generic": (),
}
# numba target for an ISA that is narrower than the CPU's best: a CPU with just those features
_TARGET = {
    ("avxvnni", "x86_64"): "alderlake",
    ("avx2", "x86_64"): "haswell",
    ("generic", "x86_64"): "x86-64",
    ("neon", "aarch64"): "cortex-a76",
    ("generic", "aarch64"): "generic",
}
# where an ISA runs, for a person: the CPU it needs, and how to run it elsewhere (skip
# messages, docs); the neon entry names the settings tools/arm64_testbed.sh uses
WHERE = {
    "avx512vnni": "an x86-64 CPU with AVX-512 VNNI (Ice Lake, Zen 4)",
    "avxvnni": "an x86-64 CPU with AVX-VNNI (Alder Lake or later)",
    "avx2": "an x86-64 CPU with AVX2, FMA and F16C",
    "neon": "an aarch64 CPU with dotprod; the arm64 qemu test bed runs it "
            f"(EDGETP_ISA=neon NUMBA_CPU_NAME={_TARGET['neon', 'aarch64']})",
    "generic": "any CPU",
}
# the ISA of a NUMBA_CPU_NAME a user set; names not listed count as generic
_CPU_ISA = {
    **dict.fromkeys(("haswell", "broadwell", "skylake", "znver1", "znver2", "znver3"), "avx2"),
    **dict.fromkeys(("alderlake", "raptorlake", "meteorlake", "arrowlake", "gracemont"), "avxvnni"),
    **dict.fromkeys(("cascadelake", "cooperlake", "icelake-client", "icelake-server", "tigerlake", "rocketlake",
                     "sapphirerapids", "emeraldrapids", "graniterapids", "znver4", "znver5"), "avx512vnni"),
    **dict.fromkeys(("cortex-a76", "cortex-a77", "cortex-a78", "cortex-x1", "neoverse-n1", "neoverse-n2",
                     "neoverse-v1", "apple-m1", "apple-m2"), "neon"),
}  # fmt: skip


class IsaError(RuntimeError):
    """A forced ISA this CPU cannot run, or an unknown ISA name."""


@dataclass(frozen=True)
class Choice:
    isa: str  # one of ISAS
    target: str | None  # the NUMBA_CPU_NAME to compile for; None: numba's default (this CPU)
    reason: str  # why, for the log and `edgetp status`


def usable(arch: str, features: frozenset[str]) -> tuple[str, ...]:
    """The ISAs a CPU of this architecture with these features can run, best first."""
    return tuple(i for i in ISAS if _ARCH.get(i, arch) == arch and all(f in features for f in _NEEDS[i]))


def choose(env: Mapping[str, str], arch: str, features: frozenset[str],
           llvm_features: frozenset[str] | None = None) -> Choice:
    """The ISA for this process (pure: environment, architecture and CPU features in).

    llvm_features: what LLVM itself sees of this CPU (numba compiles for that). Where it
    lacks what the ISA needs (qemu-user shows LLVM a "generic" aarch64, though the kernel's
    HWCAP has the dot product), the ISA compiles for a named CPU that has it; otherwise
    LLVM cannot select the instructions and aborts.
    """
    can = usable(arch, features)
    forced = env.get("EDGETP_ISA", "").strip().lower()
    user_target = env.get("NUMBA_CPU_NAME") or None
    if forced and forced not in ISAS:
        raise IsaError(f"EDGETP_ISA={forced} is not an ISA edgetp knows (choose from {', '.join(ISAS)})")
    if forced and forced not in can:
        lacks = [f for f in _NEEDS[forced] if f not in features]
        why = f"it needs an {_ARCH[forced]} CPU" if _ARCH.get(forced, arch) != arch else f"the CPU lacks {', '.join(lacks)}"
        raise IsaError(f"EDGETP_ISA={forced} cannot run on this {arch} machine ({why}); it can run {', '.join(can)}")
    if user_target:
        isa = forced or _CPU_ISA.get(user_target, "generic")
        if isa not in can:
            raise IsaError(f"NUMBA_CPU_NAME={user_target} targets {isa} code, which this CPU cannot run ({', '.join(can)})")
        return Choice(isa, user_target, f"NUMBA_CPU_NAME={user_target}")
    isa = forced or can[0]
    # the CPU's own best ISA compiles for the CPU itself (if LLVM sees it as it is);
    # a narrower one for a CPU that has just it
    seen = llvm_features is None or all(f in llvm_features for f in _NEEDS[isa])
    target = None if isa == can[0] and seen else _TARGET.get((isa, arch))
    return Choice(isa, target, "EDGETP_ISA" if forced else "best this CPU has")


def llvm_host_features() -> frozenset[str]:
    """The CPU features LLVM sees here (what numba compiles for by default)."""
    from llvmlite import binding  # noqa: PLC0415 - llvmlite only, numba not yet

    return frozenset(k for k, v in binding.get_host_cpu_features().items() if v)


def host_features() -> tuple[str, frozenset[str]]:
    """(architecture, CPU features by LLVM's names) of this machine.

    On aarch64 the dot-product bit comes from the kernel's HWCAP (AT_HWCAP bit 20,
    ASIMDDP): LLVM reads /proc/cpuinfo, which qemu-user does not emulate.
    """
    arch = platform.machine().lower()
    arch = {"amd64": "x86_64", "arm64": "aarch64"}.get(arch, arch)
    feats = set(llvm_host_features())
    if arch == "aarch64" and sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None)
            libc.getauxval.restype = ctypes.c_ulong
            if libc.getauxval(16) & (1 << 20):  # AT_HWCAP, HWCAP_ASIMDDP
                feats.add("dotprod")
        except (OSError, AttributeError):  # pragma: no cover - no getauxval: trust LLVM's list
            pass
    return arch, frozenset(feats)


_choice: Choice | None = None
_error: IsaError | None = None


def configure() -> None:
    """Decide the ISA once and point numba at its target, before numba compiles anything.

    Never raises: a bad EDGETP_ISA is kept and raised by `require()`.
    """
    global _choice, _error
    if _choice is not None or _error is not None:
        return
    try:
        _choice = choose(os.environ, *host_features(), llvm_host_features())
    except IsaError as exc:
        _error = exc
        return
    if _choice.target:
        # numba adds the host's own features to a named CPU unless told otherwise: an AVX2
        # target on an AVX-512 machine would still emit AVX-512
        os.environ["NUMBA_CPU_NAME"] = _choice.target
        features = os.environ.setdefault("NUMBA_CPU_FEATURES", "")
        if "numba.core.config" in sys.modules:  # numba imported already: nothing is compiled yet
            from numba.core import config  # noqa: PLC0415

            config.CPU_NAME, config.CPU_FEATURES = _choice.target, features
    log.info("integer kernels: %s (%s%s)", _choice.isa, _choice.reason,
             f", compiled for {_choice.target}" if _choice.target else "")


def int8(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the integer kernels may run: EDGETP_INT8 unset, empty or 1 (or true, yes, on); 0 (or
    false, no, off) keeps every product on the float kernels. Anything else is an IsaError."""
    text = env.get("EDGETP_INT8", "").strip().lower()
    if text in ("", "1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise IsaError(f"EDGETP_INT8 must be 0 or 1, got {env['EDGETP_INT8']!r}")


def require() -> Choice:
    """The ISA in use; IsaError if EDGETP_ISA asked for one this CPU cannot run, or EDGETP_INT8
    is neither 0 nor 1."""
    configure()
    if _error is not None:
        raise _error
    int8()
    assert _choice is not None
    return _choice


def current() -> str:
    """Name of the ISA in use (see require())."""
    return require().isa
