#!/usr/bin/env bash
# The ARM path without ARM hardware: a Debian bookworm arm64 userland run by qemu-user.
#
#   tools/arm64_testbed.sh            build what is missing, then run the test groups (make test-arm64)
#   tools/arm64_testbed.sh run CMD..  build what is missing, then run CMD inside (the Pi 5 environment)
#   tools/arm64_testbed.sh clean      delete the cached rootfs
#
# Cached under ${EDGETP_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/edgetp}/arm64: the rootfs, with
# the venv (/opt/venv), numba's cache and the SmolLM2 model inside it, and one log per phase.
# The repo is bind-mounted read-only at /src and ../shared beside it at /shared, so the tests
# find ../shared/models as they do on the host.
#
# Needs root. Every mount in the rootfs lives in a private mount and PID namespace (unshare)
# that the kernel tears down, with every process in it, when the phase ends, fails, times out
# or is interrupted. The global changes, the qemu-aarch64 binfmt_misc entry and the
# binfmt_misc mount that holds it, are undone on exit (a trap) unless they were there before.
# Every phase has a timeout.
#
# Knobs: ARM64_QEMU_CPU (qemu's CPU model, default max: it has the dot product extension, and
# i8mm, which a Pi 5 lacks; cortex-a76 is exactly the Pi 5's core, qemu 7.2 has it and every
# group passes on it), ARM64_TEST_TIMEOUT (seconds per test group, default 5400), ARM64_CHILD_TIMEOUT (seconds
# for a test's child process, default the group's), ARM64_MIRROR (Debian mirror), ARM64_GROUPS (the
# test groups to run, by name: kernels-neon kernels-generic stories parallel startup caches families; default
# all).
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
SHARED="$(cd "$REPO/.." && pwd)/shared"
CACHE="${EDGETP_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/edgetp}"
ARM="$CACHE/arm64"
ROOT="$ARM/rootfs"
LOGS="$ARM/logs"
QEMU_CPU="${ARM64_QEMU_CPU:-max}"
TEST_TIMEOUT="${ARM64_TEST_TIMEOUT:-5400}"
# a test's child process that compiles every kernel of one ISA: a quarter of an hour natively
# is far too little under emulation on a busy machine (a cold generic child of test_intdot
# took over 15 minutes on the 2-vCPU VM)
CHILD_TIMEOUT="${ARM64_CHILD_TIMEOUT:-$TEST_TIMEOUT}"
MIRROR="${ARM64_MIRROR:-http://deb.debian.org/debian}"
SMOLLM2=SmolLM2-135M-Instruct.Q4_1.gguf
BINFMT=/proc/sys/fs/binfmt_misc
# the Raspberry Pi 5 as edgetp sees it: NEON with sdot, numba compiling for its core
# (under qemu-user LLVM cannot read the CPU and would see "generic")
PI5=(EDGETP_ISA=neon NUMBA_CPU_NAME=cortex-a76)

say() { printf '[arm64] %s\n' "$*"; }
die() { printf '[arm64] error: %s\n' "$*" >&2; exit 1; }

if [ "$(id -u)" -ne 0 ]; then
    echo "tools/arm64_testbed.sh needs root (apt-get, binfmt_misc, chroot and mounts); run it as root" >&2
    exit 1
fi

# ---- bounded jobs that a signal can interrupt ---------------------------------------------
job=""           # pid of the running phase (a `timeout`), killed on exit
shower=""        # pid of the tail that shows its log
registered=""    # set when this run registered the binfmt entry
reported=""
mounted_binfmt=""  # set when this run mounted binfmt_misc
declare -a summary=()

cleanup() {
    local rc=$?
    trap - EXIT INT TERM
    if [ -n "$job" ] && kill -0 "$job" 2>/dev/null; then
        say "stopping the running phase (pid $job)"
        kill -TERM "$job" 2>/dev/null || true
        for _ in $(seq 20); do kill -0 "$job" 2>/dev/null || break; sleep 0.5; done
        kill -KILL "$job" 2>/dev/null || true
    fi
    [ -z "$shower" ] || kill "$shower" 2>/dev/null || true
    [ ${#summary[@]} -eq 0 ] || [ -n "$reported" ] || report
    if [ -n "$registered" ]; then
        { [ ! -e "$BINFMT/qemu-aarch64" ] || echo -1 > "$BINFMT/qemu-aarch64"; } \
            && say "binfmt entry qemu-aarch64 removed" || say "could not remove binfmt entry qemu-aarch64"
    fi
    if [ -n "$mounted_binfmt" ]; then
        timeout 30 umount "$BINFMT" && say "binfmt_misc unmounted" || say "could not unmount $BINFMT"
    fi
    exit "$rc"
}
trap cleanup EXIT
trap 'say "interrupted"; exit 130' INT
trap 'say "terminated"; exit 143' TERM

# bounded SECONDS LOG CMD...: run CMD in the background (so INT/TERM reach the trap at once) with
# a timeout, its output appended to LOG ("-": not logged) and shown as it comes; returns CMD's
# status (124 on timeout)
bounded() {
    local limit=$1 log=$2; shift 2
    local rc=0
    if [ "$log" = - ]; then
        timeout -k 20 "$limit" "$@" &
        job=$!
    else
        mkdir -p "$(dirname "$log")"
        touch "$log"
        local from=$(($(stat -c %s "$log") + 1))
        timeout -k 20 "$limit" "$@" >>"$log" 2>&1 &
        job=$!
        # shown from the background too: bash runs a trap only once the foreground command ends,
        # and a tail in the foreground would hold a TERM or INT sent to this script for the phase
        tail -c "+$from" -f --pid="$job" "$log" &
        shower=$!
    fi
    wait "$job" || rc=$?
    job=""
    if [ -n "$shower" ]; then  # it stops within a second of the job (--pid)
        wait "$shower" || true
        shower=""
    fi
    [ "$rc" -ne 124 ] || say "timed out after ${limit}s: $*"
    return "$rc"
}

# phase NAME CMD...: a bounded step whose duration goes into the summary
phase() {
    local name=$1; shift
    local t0=$SECONDS rc=0
    "$@" || rc=$?
    local took=$((SECONDS - t0))
    say "phase $name: $((took / 60))m$((took % 60))s$([ "$rc" -eq 0 ] || echo " (exit $rc)")"
    summary+=("$(printf '%-22s %4dm%02ds  %s' "$name" $((took / 60)) $((took % 60)) "${result:-}")")
    result=""
    return "$rc"
}
result=""

# ---- host packages and the binfmt entry ---------------------------------------------------
host_packages() {
    local missing=()
    for pkg in qemu-user-static mmdebstrap; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    say "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    bounded 600 - apt-get update -qq || return
    bounded 900 - apt-get install -y -qq "${missing[@]}" >/dev/null
}

# The entry lives only while binfmt_misc is mounted somewhere (kernel 6.7 and later drop the
# entries with the last mount), so it is mounted on the host for the run, like the entry
register_binfmt() {
    local conf=/usr/lib/binfmt.d/qemu-aarch64.conf
    [ -r "$conf" ] || die "$conf is missing (qemu-user-static not installed?)"
    if ! mountpoint -q "$BINFMT"; then
        timeout 30 mount -t binfmt_misc binfmt_misc "$BINFMT" || die "cannot mount binfmt_misc on $BINFMT"
        mounted_binfmt=1
    fi
    if [ -e "$BINFMT/qemu-aarch64" ]; then
        # registered by someone else: usable in a chroot only with F (interpreter opened at registration)
        grep -q '^flags:.*F' "$BINFMT/qemu-aarch64" \
            || die "binfmt entry qemu-aarch64 exists without the F flag; it cannot run inside a chroot"
        say "binfmt entry qemu-aarch64 already registered (left as it is)"
        return 0
    fi
    # :name:type:offset:magic:mask:interpreter:flags -- make sure of F, keep the rest
    local line
    line="$(grep -v '^#' "$conf" | grep -m1 ':qemu-aarch64:')"
    case "${line##*:}" in *F*) ;; *) line="${line}F" ;; esac
    printf '%s' "$line" > "$BINFMT/register"
    registered=1
    say "binfmt entry qemu-aarch64 registered (interpreter $(cut -d: -f7 <<<"$line"), flags $(cut -d: -f8 <<<"$line"); removed on exit)"
}

# ---- running things inside ----------------------------------------------------------------
# The environment inside: nothing from the host but what is listed here.
inside_env() {
    echo HOME=/root PATH=/opt/venv/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 TMPDIR=/tmp \
        QEMU_CPU="$QEMU_CPU" PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_DISABLE_PIP_VERSION_CHECK=1 \
        PIP_DEFAULT_TIMEOUT=180 SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt \
        EDGETP_CACHE_DIR=/var/cache/edgetp NUMBA_CACHE_DIR=/var/cache/numba \
        PYTHONPYCACHEPREFIX=/var/cache/pycache OPENBLAS_NUM_THREADS=1 PYTHONUNBUFFERED=1 \
        EDGETP_TEST_CHILD_TIMEOUT="$CHILD_TIMEOUT"
}

# in_root SECONDS LOG [VAR=VALUE...] CMD...: run CMD in the rootfs, in its own mount and PID
# namespace (unmounted and killed, all of it, when this returns), output to the terminal and LOG
in_root() {
    local limit=$1 log=$2; shift 2
    mkdir -p "$ROOT/src" "$ROOT/shared" "$LOGS"
    # the host's CA bundle: the registries may sit behind the host's TLS proxy
    cp /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/certs/ca-certificates.crt" || return
    cp -L /etc/resolv.conf "$ROOT/etc/resolv.conf" || return
    local inner='
        set -e
        R=$1; shift
        mount -t proc proc "$R/proc"
        mount --bind /dev "$R/dev"
        mount -t tmpfs -o mode=1777 shm "$R/dev/shm"
        mount -t sysfs -o ro sysfs "$R/sys"
        mount --bind -o ro "$SRC" "$R/src"
        [ ! -d "$SHARED" ] || mount --bind -o ro "$SHARED" "$R/shared"
        rc=0
        chroot "$R" /usr/bin/env -i "$@" || rc=$?
        exit $rc'
    # --kill-child: if unshare dies (timeout, Ctrl-C), its child, PID 1 of the namespace, and
    # with it every process inside, gets SIGKILL; the namespace's mounts go with it
    # shellcheck disable=SC2046
    SRC="$REPO" SHARED="$SHARED" bounded "$limit" "$log" \
        unshare --mount --propagation private --pid --fork --kill-child --mount-proc \
        bash -c "$inner" inner "$ROOT" $(inside_env) "$@"
}

# ---- phases -------------------------------------------------------------------------------
build_rootfs() {
    if [ -e "$ROOT/.edgetp-rootfs" ]; then
        result="cached"
        return 0
    fi
    say "building the arm64 rootfs in $ROOT (mmdebstrap, a few minutes)"
    rm -rf "$ROOT.new" "$ROOT" "$LOGS/rootfs.log"
    bounded 1800 "$LOGS/rootfs.log" unshare --mount --propagation private --pid --fork --kill-child --mount-proc \
        mmdebstrap --arch=arm64 --variant=apt --include=python3,python3-venv,python3-pip,ca-certificates \
        bookworm "$ROOT.new" "$MIRROR" || return
    mv "$ROOT.new" "$ROOT" && touch "$ROOT/.edgetp-rootfs"
    result="built"
}

# the project's dependencies and test extras, read from pyproject.toml
requirements() {
    python3 - "$REPO/pyproject.toml" <<'EOF'
import sys, tomllib
p = tomllib.load(open(sys.argv[1], "rb"))["project"]
print("\n".join(p["dependencies"] + p["optional-dependencies"]["test"]))
EOF
}

install_venv() {
    local want stamp="$ROOT/opt/venv/.edgetp-requirements"
    want="$(requirements)" || die "cannot read the requirements from pyproject.toml (host python3 >= 3.11 needed)"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
        result="cached ($(grep -c . "$stamp") requirements)"
        return 0
    fi
    printf '%s\n' "$want" > "$ROOT/tmp/requirements.txt"
    say "creating /opt/venv and installing $(grep -c . <<<"$want") requirements (numba/numpy aarch64 wheels)"
    # all at once; if that fails, one by one, and name what would not install
    local script='
        set -u
        [ -x /opt/venv/bin/python ] || python3 -m venv /opt/venv
        if ! pip install -q -r /tmp/requirements.txt; then
            echo "[arm64] installing all at once failed; one by one"
            : > /tmp/failed.txt
            while read -r req; do
                pip install -q "$req" || echo "$req" >> /tmp/failed.txt
            done < /tmp/requirements.txt
        fi
        # the project itself, editable without writing into the read-only /src
        site=$(python -c "import sysconfig; print(sysconfig.get_paths()[\"purelib\"])")
        echo /src > "$site/edgetp-src.pth"
        printf "#!/opt/venv/bin/python\nimport sys\nfrom edgetp.cli import main\nsys.exit(main())\n" > /opt/venv/bin/edgetp
        chmod +x /opt/venv/bin/edgetp
        python -c "import numpy, numba, llvmlite; print(\"[arm64] numpy\", numpy.__version__, \"numba\", numba.__version__, \"LLVM\", llvmlite.binding.llvm_version_info)"'
    rm -f "$ROOT/tmp/failed.txt"
    in_root 2400 "$LOGS/venv.log" bash -c "$script" || return
    local failed=""
    [ ! -s "$ROOT/tmp/failed.txt" ] || failed="$(tr '\n' ' ' < "$ROOT/tmp/failed.txt")"
    printf '%s\n' "$want" > "$stamp"
    result="installed${failed:+; FAILED: $failed}"
    [ -z "$failed" ] || say "not installed inside (their tests skip or fail there): $failed"
}

# SmolLM2 in the rootfs's edgetp cache: a copy of the host's if it has one, else `edgetp model pull`
fetch_models() {
    local dest="$ROOT/var/cache/edgetp/models/$SMOLLM2"
    if [ -s "$dest" ]; then
        result="cached"
        return 0
    fi
    mkdir -p "$(dirname "$dest")"
    if [ -s "$CACHE/models/$SMOLLM2" ]; then
        cp "$CACHE/models/$SMOLLM2" "$dest.tmp" && mv "$dest.tmp" "$dest" || return
        result="copied from the host cache"
    else
        in_root 1200 "$LOGS/models.log" edgetp model pull smollm2 || return
        result="pulled inside"
    fi
}

prepare() {
    phase "host packages" host_packages
    register_binfmt
    phase "build rootfs" build_rootfs
    phase "pip install" install_venv
    phase "models" fetch_models
}

# test_group NAME [VAR=VALUE...] -- PYTEST ARGS...: pytest inside, from a writable directory
test_group() {
    local name=$1; shift
    local envs=()
    while [ "$1" != "--" ]; do envs+=("$1"); shift; done
    shift
    if [ -n "${ARM64_GROUPS:-}" ] && [[ " $ARM64_GROUPS " != *" $name "* ]]; then
        result="not selected (ARM64_GROUPS=$ARM64_GROUPS)"
        return 0
    fi
    local log="$LOGS/test-$name.log"
    : > "$log"
    say "== $name: ${envs[*]:-} pytest $* =="
    local rc=0
    in_root "$TEST_TIMEOUT" "$log" "${envs[@]}" bash -c 'mkdir -p /work && cd /work && exec "$@"' pytest \
        python -m pytest -c /src/pyproject.toml --rootdir=/src -p no:cacheprovider -q -rfEs "$@" || rc=$?
    # pytest's last line: "12 passed, 3 skipped in 40.1s"
    result="$(grep -E '(passed|failed|skipped|error|no tests ran).* in [0-9.]+s' "$log" | tail -1 | tr -d '=' | sed 's/^ *//')"
    [ -n "$result" ] || result="no pytest summary (exit $rc)"
    return "$rc"
}

# kernel_tests [EXTRA...]: the kernel test files (those of EXTRA that exist too), as paths inside
kernel_tests() {
    local files=(/src/tests/test_quant.py) f
    for f in test_intdot.py "$@"; do
        [ ! -f "$REPO/tests/$f" ] || files+=("/src/tests/$f")
    done
    echo "${files[@]}"
}

run_tests() {
    local failures=0 kernels
    kernels="$(kernel_tests)"
    # neon: test_quant's int8_kernels cases run the NEON decode (intdot, sdot) and prefill
    # (intgemm's neon tiles) in this process; test_intdot and test_intgemm_isa run a child
    # per ISA (neon, generic) and hold their bits to each other and to numpy; the several-token
    # decode kernel (sdot chained into one accumulator) against each token alone. The generic
    # group runs the kernels of the generic ISA in-process (its children repeat the above).
    # shellcheck disable=SC2046
    phase "kernels neon" test_group kernels-neon "${PI5[@]}" -- $(kernel_tests test_intgemm_isa.py) \
        /src/tests/test_batch_rows.py::test_several_token_kernel_is_each_tokens_canonical_bits \
        || failures=$((failures + 1))
    # shellcheck disable=SC2086
    phase "kernels generic" test_group kernels-generic EDGETP_ISA=generic -- $kernels || failures=$((failures + 1))
    # greedy text of stories260K ("Once upon a time ... Lily"), its logits against the float64
    # math, SmolLM2's "Paris"; the llama.cpp comparisons among them skip (no binding inside)
    phase "stories260K text" test_group stories "${PI5[@]}" -- /src/tests/test_generate.py \
        /src/tests/test_engine_reference.py -k "test_generate or stories or paris" || failures=$((failures + 1))
    phase "tensor parallel" test_group parallel "${PI5[@]}" -- /src/tests/test_parallel.py \
        -k "not smollm2 and not tiny" || failures=$((failures + 1))
    # a second process loads every kernel the first compiled from numba's cache and compiles none
    # (a Pi's start: each compile there costs minutes under qemu, seconds on the Pi itself)
    phase "kernels from the cache" test_group startup "${PI5[@]}" -- \
        /src/tests/test_jitcache.py::test_a_second_process_loads_every_kernel_the_first_compiled_and_compiles_none \
        || failures=$((failures + 1))
    # the KV cache in every type (f16's conversions, q8_0's blocks) and several-token rows against
    # single rows (68 minutes under qemu on a 2-vCPU AVX2 EPYC, 7 Dec: past the old 60-minute limit)
    phase "caches and rows" test_group caches "${PI5[@]}" -- /src/tests/test_kv_type.py \
        /src/tests/test_batch_rows.py || failures=$((failures + 1))
    # the layers of the other families on the NEON kernels: int8 decode and the fused plan
    phase "model families" test_group families "${PI5[@]}" -- /src/tests/test_qwen3.py \
        /src/tests/test_gemma.py /src/tests/test_phi3.py /src/tests/test_smollm3.py /src/tests/test_mistral3.py \
        /src/tests/test_moe.py -k int8 \
        || failures=$((failures + 1))
    return "$failures"
}

report() {
    reported=1
    say "summary (QEMU_CPU=$QEMU_CPU, logs in $LOGS):"
    printf '  %s\n' "${summary[@]}"
}

case "${1:-test}" in
    test)
        t0=$SECONDS
        prepare
        rc=0
        run_tests || rc=$?
        summary+=("$(printf '%-22s %4dm%02ds' total $(((SECONDS - t0) / 60)) $(((SECONDS - t0) % 60)))")
        report
        exit "$rc"
        ;;
    run)
        shift
        [ $# -gt 0 ] || die "usage: $0 run CMD..."
        prepare
        in_root "$TEST_TIMEOUT" "$LOGS/run.log" "${PI5[@]}" "$@"
        ;;
    clean)
        rm -rf "$ROOT" "$ROOT.new" "$LOGS"
        say "removed $ROOT"
        ;;
    *)
        die "usage: $0 [test | run CMD... | clean]"
        ;;
esac
