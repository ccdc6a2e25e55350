#!/usr/bin/env bash
# Build a real Kubernetes control plane from Go modules and cache it by version (issue 19):
# kube-apiserver, kube-controller-manager, kube-scheduler (k8s.io/kubernetes), etcd
# (go.etcd.io/etcd/server/v3) and kwok (sigs.k8s.io/kwok), plus kwok's stage files.
#
#   scripts/build-control-plane.sh            build unless the cache already holds this version
#   scripts/build-control-plane.sh --print    print the cache directory and exit
#
# Versions are pinned in scripts/control-plane.versions. Binaries land in
#   ${DYNAMOGRAPH_CONTROL_PLANE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dynamograph/control-plane}/<key>/
# with a VERSIONS stamp written last; a warm machine (stamp present, binaries runnable) skips the
# build entirely. Go's own module and build caches (GOMODCACHE, GOCACHE) are Go's defaults.
#
# Why a wrapper module: k8s.io/kubernetes lists its staging modules (k8s.io/api, apimachinery,
# apiserver, client-go, ...) as v0.0.0, so `go install k8s.io/kubernetes/cmd/...@vX` cannot
# work. The wrapper requires k8s.io/kubernetes vX and replaces every `k8s.io/<m> v0.0.0` found in
# that release's go.mod with the published tag v0.<minor>.<patch>. etcd's server module has
# relative replaces too; k8s 1.36 pins etcd in its own go.mod, so etcd is built from the same
# graph. kwok has no replaces and is `go install`ed on its own. Needs Go >= 1.26 and the Go
# module proxy (or a warm GOMODCACHE). A cold build takes tens of minutes on two cores.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
. scripts/control-plane.versions

ROOT=${DYNAMOGRAPH_CONTROL_PLANE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dynamograph/control-plane}
KEY="k8s-${K8S_VERSION}_etcd-${ETCD_VERSION}_kwok-${KWOK_VERSION}"
DEST="$ROOT/$KEY"
BINARIES=(kube-apiserver kube-controller-manager kube-scheduler etcd kwok)
STAMP="K8S_VERSION=$K8S_VERSION ETCD_VERSION=$ETCD_VERSION KWOK_VERSION=$KWOK_VERSION"

if [ "${1:-}" = "--print" ]; then
    echo "$DEST"
    exit 0
fi

log() { echo "build-control-plane: $*"; }

warm() {
    [ -f "$DEST/VERSIONS" ] && [ "$(cat "$DEST/VERSIONS")" = "$STAMP" ] || return 1
    for b in "${BINARIES[@]}"; do [ -x "$DEST/bin/$b" ] || return 1; done
    [ -f "$DEST/stages/pod-ready.yaml" ] || return 1
    "$DEST/bin/kube-apiserver" --version 2>/dev/null | grep -qx "Kubernetes $K8S_VERSION"
}

if warm; then
    log "cached: $DEST ($STAMP)"
    exit 0
fi

if ! command -v go >/dev/null 2>&1; then
    log "go is not on PATH; install Go >= 1.26 to build the control plane" >&2
    exit 1
fi

START=$(date +%s)
elapsed() { echo "$(( $(date +%s) - START ))s"; }
mkdir -p "$ROOT"
WORK=$(mktemp -d "$ROOT/.build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/bin" "$WORK/stages" "$WORK/wrapper"
export CGO_ENABLED=0 GOFLAGS="-mod=mod -buildvcs=false" GOTOOLCHAIN=local

# Progress for long `go build -v` runs: one line every 100 packages compiled.
progress() {
    awk -v what="$1" '/[ :]/ { print; fflush(); next } { n++; if (n % 100 == 0) { printf "build-control-plane: %s: %d packages...\n", what, n; fflush() } }
        END { printf "build-control-plane: %s: %d packages compiled\n", what, n }'
}

log "cold build of $STAMP into $DEST (Go $(go env GOVERSION), GOMODCACHE=$(go env GOMODCACHE))"

# --- the wrapper module --------------------------------------------------------------------
log "[1/4] reading k8s.io/kubernetes@$K8S_VERSION go.mod ($(elapsed))"
K8S_GOMOD=$(cd "$WORK" && go mod download -json "k8s.io/kubernetes@$K8S_VERSION" |
    sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p')
[ -f "$K8S_GOMOD" ] || { log "could not read k8s.io/kubernetes@$K8S_VERSION go.mod" >&2; exit 1; }
STAGING_TAG="v0.${K8S_VERSION#v1.}"        # v1.36.3 -> v0.36.3
{
    echo "module dynamograph.local/control-plane"
    echo
    grep -E '^go [0-9]' "$K8S_GOMOD"
    grep -E '^godebug ' "$K8S_GOMOD" || true
    echo
    echo "require ("
    echo "	k8s.io/kubernetes $K8S_VERSION"
    echo "	go.etcd.io/etcd/server/v3 $ETCD_VERSION"
    echo ")"
    echo
    echo "replace ("
    # every `k8s.io/<m> v0.0.0` requirement of this release -> its published staging tag
    grep -oE '^[[:space:]]*k8s\.io/[A-Za-z0-9._/-]+ v0\.0\.0([[:space:]]|$)' "$K8S_GOMOD" |
        awk '{print $1}' | sort -u |
        while read -r m; do echo "	$m v0.0.0 => $m $STAGING_TAG"; done
    echo ")"
} >"$WORK/wrapper/go.mod"
# a package so the module is buildable; the commands are built by import path
printf 'package wrapper\n' >"$WORK/wrapper/doc.go"
log "wrapper: $(grep -c '=>' "$WORK/wrapper/go.mod") staging replaces to $STAGING_TAG"

# --- kube-apiserver, kube-controller-manager, kube-scheduler, etcd --------------------------
MINOR=${K8S_VERSION#v1.}; MINOR=${MINOR%%.*}
VPKG=k8s.io/component-base/version
LDFLAGS="-s -w -X $VPKG.gitVersion=$K8S_VERSION -X $VPKG.gitMajor=1 -X $VPKG.gitMinor=$MINOR"
LDFLAGS="$LDFLAGS -X $VPKG.gitTreeState=clean -X $VPKG.buildDate=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
LDFLAGS="$LDFLAGS -X k8s.io/client-go/pkg/version.gitVersion=$K8S_VERSION"
log "[2/4] downloading modules ($(elapsed))"
(cd "$WORK/wrapper" && go mod download k8s.io/kubernetes go.etcd.io/etcd/server/v3 >/dev/null &&
    go list -deps k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
        k8s.io/kubernetes/cmd/kube-scheduler go.etcd.io/etcd/server/v3 >/dev/null)
log "[3/4] compiling kube-apiserver, kube-controller-manager, kube-scheduler, etcd ($(elapsed))"
(cd "$WORK/wrapper" && nice -n "${BUILD_NICE:-10}" go build -v -trimpath -ldflags "$LDFLAGS" -o "$WORK/bin/" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler go.etcd.io/etcd/server/v3 2>&1) | progress kubernetes
# go names the etcd binary after its package path (go.etcd.io/etcd/server/v3 -> `server`)
mv "$WORK/bin/server" "$WORK/bin/etcd"

# --- kwok ----------------------------------------------------------------------------------
log "[4/4] compiling kwok $KWOK_VERSION ($(elapsed))"
(cd "$WORK/wrapper" && GOBIN="$WORK/bin" GOFLAGS=-buildvcs=false nice -n "${BUILD_NICE:-10}" \
    go install -v -trimpath -ldflags "-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION" 2>&1) | progress kwok
KWOK_DIR=$(cd "$WORK/wrapper" && go mod download -json "sigs.k8s.io/kwok@$KWOK_VERSION" |
    sed -n 's/^[[:space:]]*"Dir": "\(.*\)",\{0,1\}$/\1/p')
S="$KWOK_DIR/kustomize/stage"
for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
    pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
    cp "$S/$f" "$WORK/stages/"
done
chmod u+w "$WORK/stages/"*

for b in "${BINARIES[@]}"; do
    [ -x "$WORK/bin/$b" ] || { log "missing $b after the build" >&2; exit 1; }
done
# (no `| head`: with pipefail, the SIGPIPE of a multi-line --version would fail the script)
for b in kube-apiserver etcd kwok; do
    out=$("$WORK/bin/$b" --version 2>&1) || { log "$b --version failed: $out" >&2; exit 1; }
    log "$b: ${out%%$'\n'*}"
done

rm -rf "$DEST"
mkdir -p "$DEST"
mv "$WORK/bin" "$WORK/stages" "$DEST/"
cp "$WORK/wrapper/go.mod" "$DEST/wrapper.go.mod"
echo "$STAMP" >"$DEST/VERSIONS"
log "done in $(elapsed): $DEST"
