#!/usr/bin/env bash
# Build the field's own Go components that benchmarks and interop tests run beside ours (issue
# 22) and cache them by version. Bench-only: not part of `make setup` or `make test`.
#
#   scripts/build-counterparts.sh [NAME ...]          build NAMEs (default: all) unless cached
#   scripts/build-counterparts.sh --print [NAME ...]  print paths and exit (builds nothing)
#
# NAMEs (binaries):
#   sim       llm-d vLLM simulator      bin/llm-d-inference-sim
#   gaie-epp  GAIE reference EPP        bin/epp
#   llmd-epp  llm-d inference scheduler bin/epp
#
# The lookup interface other tools use: `--print NAME` prints the absolute path of NAME's binary,
# one line per NAME, and exits 0 only when every one of them is built for the pinned version
# (1 otherwise, the paths still printed); `--print` alone prints the cache root. Python callers
# use bench/counterparts.py (`binary("gaie-epp") -> Path | None`), which follows the same rule.
#
# Versions (and `go install` paths) are pinned in scripts/counterparts.versions. Each binary lands
# in its own directory, because both EPPs are named `epp`:
#   ${DYNAMOGRAPH_COUNTERPARTS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dynamograph/counterparts}/
#       <name>-<version>/bin/<binary>      and   <name>-<version>/VERSIONS (written last)
# A warm machine (stamp equal to the pinned package@version, followed by its replaces if any,
# binary executable) skips the build; a changed replace rebuilds.
# A component without replaces is built inside its downloaded module (its own go.mod and go.sum);
# one with <NAME>_REPLACE (old=new@version, comma-separated) in a wrapper module made for the
# build: it requires module@version, carries the replaces (a replace only counts in the main
# module), imports the package from a tools.go, `go mod tidy -e`, then builds the package.
# Go's module and build caches (GOMODCACHE, GOCACHE) are Go's defaults. All three are pure Go
# (CGO_ENABLED=0). Needs Go >= 1.25 and the Go module proxy (or a warm GOMODCACHE); a cold build
# of the simulator takes minutes on two cores, each EPP (Kubernetes client, controller-runtime)
# tens of minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
. scripts/counterparts.versions

ROOT=${DYNAMOGRAPH_COUNTERPARTS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dynamograph/counterparts}
ALL=(sim gaie-epp llmd-epp)

log() { echo "build-counterparts: $*"; }

# name -> its replaces, "old=new@version" comma-separated, or nothing (from the versions file)
replaces() {
    case "$1" in
    sim) echo "${SIM_REPLACE:-}" ;;
    gaie-epp) echo "${GAIE_EPP_REPLACE:-}" ;;
    llmd-epp) echo "${LLMD_EPP_REPLACE:-}" ;;
    esac
}

# name -> "module package version" (from the versions file)
spec() {
    case "$1" in
    sim) echo "$SIM_MODULE $SIM_PACKAGE $SIM_VERSION" ;;
    gaie-epp) echo "$GAIE_EPP_MODULE $GAIE_EPP_PACKAGE $GAIE_EPP_VERSION" ;;
    llmd-epp) echo "$LLMD_EPP_MODULE $LLMD_EPP_PACKAGE $LLMD_EPP_VERSION" ;;
    *) log "unknown component '$1' (known: ${ALL[*]})" >&2; return 1 ;;
    esac
}

dest() { local mod pkg ver; read -r mod pkg ver <<<"$(spec "$1")"; echo "$ROOT/$1-$ver"; }
path() { local mod pkg ver; read -r mod pkg ver <<<"$(spec "$1")"; echo "$(dest "$1")/bin/${pkg##*/}"; }
stamp() {
    local mod pkg ver rep
    read -r mod pkg ver <<<"$(spec "$1")"
    rep=$(replaces "$1")
    echo "$pkg@$ver${rep:+ replace $rep}"
}

warm() {
    local d
    d=$(dest "$1")
    [ -f "$d/VERSIONS" ] && [ "$(cat "$d/VERSIONS")" = "$(stamp "$1")" ] && [ -x "$(path "$1")" ]
}

if [ "${1:-}" = "--print" ]; then
    shift
    if [ $# -eq 0 ]; then
        echo "$ROOT"
        exit 0
    fi
    status=0
    for name in "$@"; do
        path "$name"
        warm "$name" || status=1
    done
    exit "$status"
fi

# Go with the settings every build here uses. GOTOOLCHAIN=local: the installed Go, never a
# downloaded toolchain. GOWORK=off: GAIE's module ships a go.work naming a ./conformance module
# that its zip does not hold.
gocmd() { CGO_ENABLED=0 GOTOOLCHAIN=local GOWORK=off nice -n "${BUILD_NICE:-10}" go "$@"; }

# Build $pkg of $mod@$ver inside the downloaded module, as its own main module (its go.mod and
# go.sum, read only), not with `go install pkg@version`: that also lists the module's versions to
# look for a deprecation, and the proxy here refuses version lists (403).
build_in_module() {
    local mod=$1 pkg=$2 ver=$3 work=$4 dir
    dir=$(cd "$work" && gocmd mod download -json "$mod@$ver" |
        sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')
    [ -n "$dir" ] && (cd "$dir" && GOFLAGS="-buildvcs=false -mod=readonly" \
        gocmd build -trimpath -ldflags "-s -w" -o "$work/bin/" "$pkg")
}

# Build $pkg in a wrapper module requiring $mod@$ver with the replaces $rep: for a module whose
# own requirements the proxy refuses (llm-d's scheduler v0.7.1 requires llm-d-kv-cache v0.7.1:
# 403). `go mod tidy -e` resolves the rest of the graph around the replaces and goes on past
# what it cannot resolve (the build then fails if the package needed it).
build_in_wrapper() {
    local mod=$1 pkg=$2 ver=$3 work=$4 rep=$5 r
    mkdir -p "$work/wrap"
    # chained with &&: set -e is off in a function called on the left of ||
    (
        cd "$work/wrap" &&
            gocmd mod init dynamograph.local/counterpart-wrapper 2>/dev/null &&
            gocmd mod edit -require="$mod@$ver" &&
            for r in ${rep//,/ }; do gocmd mod edit -replace="$r" || exit 1; done &&
            # a main package cannot be imported: the tag keeps it out of the build; tidy reads it
            printf '//go:build tools\n\npackage tools\n\nimport _ "%s"\n' "$pkg" >tools.go &&
            GOFLAGS=-mod=mod gocmd mod tidy -e &&
            GOFLAGS="-buildvcs=false -mod=readonly" gocmd build -trimpath -ldflags "-s -w" \
                -o "$work/bin/" "$pkg"
    )
}

build() {
    local name=$1 mod pkg ver rep d work start
    read -r mod pkg ver <<<"$(spec "$name")"
    rep=$(replaces "$name")
    d=$(dest "$name")
    if warm "$name"; then
        log "$name: cached: $(path "$name")"
        return 0
    fi
    start=$(date +%s)
    mkdir -p "$ROOT"
    work=$(mktemp -d "$ROOT/.build-$name.XXXXXX")
    # shellcheck disable=SC2064  # expand $work now: the trap outlives this function's locals
    trap "rm -rf '$work'" EXIT  # an interrupted build leaves nothing behind
    log "$name: cold build of $(stamp "$name") (Go $(go env GOVERSION))"
    if [ -n "$rep" ]; then
        build_in_wrapper "$mod" "$pkg" "$ver" "$work" "$rep" || {
            rm -rf "$work"
            log "$name: build of $(stamp "$name") in a wrapper module failed" >&2
            return 1
        }
    elif ! build_in_module "$mod" "$pkg" "$ver" "$work"; then
        rm -rf "$work"
        log "$name: build of $pkg@$ver failed" >&2
        return 1
    fi
    rm -rf "$d"
    mkdir -p "$d"
    mv "$work/bin" "$d/"
    rm -rf "$work"
    stamp "$name" >"$d/VERSIONS"
    log "$name: done in $(($(date +%s) - start))s: $(path "$name")"
}

if ! command -v go >/dev/null 2>&1; then
    log "go is not on PATH; install Go >= 1.25 to build the counterparts" >&2
    exit 1
fi
[ $# -gt 0 ] || set -- "${ALL[@]}"
for name in "$@"; do spec "$name" >/dev/null; done
failed=0
for name in "$@"; do build "$name" || failed=1; done
exit "$failed"
