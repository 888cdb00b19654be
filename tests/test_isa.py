"""The ISA choice: pure rules, this machine's features against /proc/cpuinfo, and the CLI's refusal."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from edgetp.model import isa

X86_AVX512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512vnni", "avx2", "fma", "f16c"})
X86_AVX2 = frozenset({"avx2", "fma", "f16c"})
PI5 = frozenset({"neon", "dotprod"})


@pytest.mark.parametrize("arch, feats, want", [
    ("x86_64", X86_AVX512, ("avx512vnni", "avx2", "generic")),
    ("x86_64", X86_AVX2 | {"avxvnni"}, ("avxvnni", "avx2", "generic")),
    ("x86_64", X86_AVX2, ("avx2", "generic")),
    ("x86_64", frozenset({"avx2"}), ("generic",)),  # AVX2 without FMA: no avx2 path
    ("aarch64", PI5, ("neon", "generic")),
    ("aarch64", frozenset({"neon"}), ("generic",)),  # Pi 4 (Cortex-A72): no dot product
])  # fmt: skip
def test_usable_isas_follow_the_cpu_features(arch, feats, want):
    assert isa.usable(arch, feats) == want


def test_the_best_isa_is_chosen_and_compiled_for_this_cpu():
    assert isa.choose({}, "x86_64", X86_AVX512) == isa.Choice("avx512vnni", None, "best this CPU has")
    assert isa.choose({}, "aarch64", PI5).isa == "neon"


@pytest.mark.parametrize("forced, target", [("avx2", "haswell"), ("generic", "x86-64"), ("avx512vnni", None)])
def test_a_narrower_forced_isa_compiles_for_a_cpu_with_just_its_features(forced, target):
    choice = isa.choose({"EDGETP_ISA": forced}, "x86_64", X86_AVX512)
    assert (choice.isa, choice.target) == (forced, target)


@pytest.mark.parametrize("env, arch, feats, words", [
    ({"EDGETP_ISA": "neon"}, "x86_64", X86_AVX512, ["neon", "aarch64"]),
    ({"EDGETP_ISA": "avx512vnni"}, "x86_64", X86_AVX2, ["avx512vnni", "avx512f"]),
    ({"EDGETP_ISA": "avx2"}, "aarch64", PI5, ["avx2", "x86_64"]),
    ({"EDGETP_ISA": "sse9"}, "x86_64", X86_AVX2, ["sse9", "generic"]),
    ({"NUMBA_CPU_NAME": "icelake-server"}, "x86_64", X86_AVX2, ["icelake-server", "avx512vnni"]),
])  # fmt: skip
def test_an_isa_the_cpu_cannot_run_is_refused_with_a_reason(env, arch, feats, words):
    with pytest.raises(isa.IsaError) as err:
        isa.choose(env, arch, feats)
    assert all(w in str(err.value) for w in words)


def test_the_integer_kernel_switch_takes_what_the_settings_take_as_booleans_and_nothing_else():
    for on in ({}, {"EDGETP_INT8": "1"}, {"EDGETP_INT8": " Yes "}, {"EDGETP_INT8": "true"}, {"EDGETP_INT8": "on"}, {"EDGETP_INT8": ""}):
        assert isa.int8(on) is True
    for off in ("0", "false", "NO", "off"):
        assert isa.int8({"EDGETP_INT8": off}) is False
    for bad in ("2", "-", "off please"):
        with pytest.raises(isa.IsaError, match=f"EDGETP_INT8 must be 0 or 1, got {bad!r}"):
            isa.int8({"EDGETP_INT8": bad})


def test_an_isa_llvm_cannot_see_on_this_cpu_compiles_for_a_cpu_that_has_it():
    # qemu-user: HWCAP says dot product, LLVM sees a "generic" aarch64 and could not select sdot
    assert isa.choose({}, "aarch64", PI5, frozenset({"neon"})) == isa.Choice("neon", "cortex-a76", "best this CPU has")
    assert isa.choose({"EDGETP_ISA": "neon"}, "aarch64", PI5, frozenset()).target == "cortex-a76"
    assert isa.choose({}, "aarch64", PI5, PI5).target is None  # a real Pi 5: compile for itself


def test_a_users_numba_target_names_the_isa():
    assert isa.choose({"NUMBA_CPU_NAME": "haswell"}, "x86_64", X86_AVX512) == isa.Choice("avx2", "haswell",
                                                                                        "NUMBA_CPU_NAME=haswell")
    assert isa.choose({"NUMBA_CPU_NAME": "cortex-a53"}, "aarch64", PI5).isa == "generic"


@pytest.mark.skipif(platform.machine() != "x86_64", reason="reads x86 flags from /proc/cpuinfo")
def test_host_features_agree_with_proc_cpuinfo():
    with open("/proc/cpuinfo") as f:
        flags = next(line for line in f if line.startswith("flags")).split(":", 1)[1].split()
    arch, feats = isa.host_features()
    assert arch == "x86_64"
    for ours, kernel in (("avx2", "avx2"), ("fma", "fma"), ("f16c", "f16c"), ("avx512f", "avx512f"),
                         ("avx512vnni", "avx512_vnni"), ("avxvnni", "avx_vnni")):
        assert (ours in feats) == (kernel in flags), ours
    best = "avx512vnni" if {"avx512_vnni", "avx512bw", "avx512vl"} <= set(flags) else "avx2"
    assert isa.usable(arch, feats)[0] == best


@pytest.mark.parametrize("forced", ["neon" if platform.machine() == "x86_64" else "avx2", "sse9"])
def test_cli_refuses_to_start_with_a_forced_isa_the_cpu_lacks(forced, stories_path):
    env = {**os.environ, "EDGETP_ISA": forced}
    run = subprocess.run([sys.executable, "-m", "edgetp", "ask", "--local", "--model", str(stories_path),
                          "--max-tokens", "2", "Once"], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and run.returncode > 0  # an exit code, not a signal (SIGILL)
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgetp: EDGETP_ISA=" + forced), run.stderr
    assert run.stdout == ""
