#!/usr/bin/env bash
# What this machine lacks to build and run the project, as Debian packages.
# The one probe `just setup`, `just setup-browser` and `.ci/run` share.
#
#   bash scripts/deps.sh              print the missing packages, one a line (nothing: all present;
#                                     a missing C compiler also gets a note on stderr)
#   bash scripts/deps.sh --browser    also what `just book-render` needs (chromium, python3)
#   bash scripts/deps.sh --install    install the missing ones with apt-get
#
# FSDP_DEPS_ROOT=DIR probes a folder laid out like / instead of this machine's
# libraries (the tests lay one out like a fresh image); commands are looked up
# on PATH. The probe uses bash builtins only, so a test can hand it any PATH.
set -euo pipefail

browser=0 install=0
for a in "$@"; do
    case "$a" in
        --browser) browser=1 ;;
        --install) install=1 ;;
        *) echo "usage: deps.sh [--browser] [--install]" >&2; exit 2 ;;
    esac
done
root=${FSDP_DEPS_ROOT:-}

has() { command -v "$1" >/dev/null 2>&1; }

# bindgen (under mpi-sys) loads libclang itself: libclang.so, libclang.so.1 or
# libclang-14.so.1, from LIBCLANG_PATH or the usual folders. LLVM's C++
# library libclang-cpp.so.14, which some images ship alone, is not it.
has_libclang() {
    local dirs=() d f
    if [ -n "${LIBCLANG_PATH:-}" ] && [ -z "$root" ]; then
        [ -f "$LIBCLANG_PATH" ] && return 0 # clang-sys takes a file too
        dirs+=("$LIBCLANG_PATH")
    fi
    dirs+=("$root"/usr/lib/llvm-*/lib "$root"/usr/lib/*-linux-gnu "$root"/usr/lib64 "$root"/usr/local/lib "$root"/usr/lib)
    for d in "${dirs[@]}"; do
        [ -d "$d" ] || continue
        for f in "$d"/libclang.so "$d"/libclang.so.* "$d"/libclang-[0-9]*.so*; do
            [ -e "$f" ] && return 0
        done
    done
    return 1
}

# A command in /usr/sbin or /sbin, which a normal user's PATH leaves out on Debian.
has_sbin() { has "$1" || [ -x "$root/usr/sbin/$1" ] || [ -x "$root/sbin/$1" ]; }

need=()
# A C compiler as `cc`: Rust links with it, and the MPI bindings and `just` build C.
if ! has cc; then
    need+=(gcc)
    [ $install -eq 1 ] || echo "note: no C compiler (cc): Rust cannot link without one; install gcc (Debian: sudo apt-get install gcc)" >&2
fi
# Open MPI's mpirun runs the lessons (ompi_info tells it from MPICH's, which
# knows none of the --mca flags the project uses); mpicc (libopenmpi-dev) is
# how mpi-sys finds MPI's headers.
{ has mpirun && has ompi_info && has mpicc; } || need+=(openmpi-bin libopenmpi-dev)
has pkg-config || need+=(pkg-config)
has_libclang || need+=(libclang-dev)
# The simulated cluster (scripts/cluster.sh, which `just test` runs): ip and tc, sysctl.
has_sbin ip && has_sbin tc || need+=(iproute2)
has_sbin sysctl || need+=(procps)
if [ $browser -eq 1 ]; then
    has chromium || has chromium-browser || need+=(chromium)
    has python3 || need+=(python3)
fi

if [ $install -eq 0 ]; then
    [ ${#need[@]} -eq 0 ] || printf '%s\n' "${need[@]}"
    exit 0
fi
[ ${#need[@]} -gt 0 ] || exit 0
if ! has apt-get; then
    echo "error: no apt-get (not a Debian-family system): install these Debian packages' counterparts yourself: ${need[*]}" >&2
    exit 1
fi
sudo=""; [ "$(id -u)" -eq 0 ] || sudo=sudo
echo "installing: ${need[*]}"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
# Installed yet still missing means the probe and Debian disagree: say so now,
# not six minutes into a build.
still=$(bash "$0" $([ $browser -eq 1 ] && echo --browser))
[ -z "$still" ] || { echo "error: installed ${need[*]}, yet still missing: $still" >&2; exit 1; }
