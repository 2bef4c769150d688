#!/usr/bin/env bash
# Builds the test control plane: kube-apiserver, kube-controller-manager (k8s.io/kubernetes at
# the version in go.mod, from the Go module proxy) and an embedded etcd, plus the Gateway API
# standard-channel CRDs. Test tooling only; the product is Python.
#
#   tools/controlplane/build.sh DEST
#
# DEST gets bin/{kube-apiserver,kube-controller-manager,etcd} and gateway-api/*.yaml. The
# caller (the Makefile) names DEST after a hash of this directory, so a second run with the same
# inputs does nothing, and a changed go.mod builds into a new directory.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
mkdir -p "$(dirname "$1")"
dest="$(cd "$(dirname "$1")" && pwd)/$(basename "$1")"
tmp="$dest.partial"
rm -rf "$tmp" && mkdir -p "$tmp/bin" "$tmp/gateway-api"

kube_version=$(awk '$1 == "k8s.io/kubernetes" { print $2 }' "$here/go.mod")
# Not a Go dependency (nothing imports it): only its CRD YAML is used.
gateway_version=v1.6.3
IFS=. read -r major minor _ <<<"${kube_version#v}"

# kube-openapi serves raw Go structs when Go's jsonv2 experiment is on (the default from Go
# 1.27), and kubectl apply then fails to download the OpenAPI document.
export GOEXPERIMENT=nojsonv2 CGO_ENABLED=0 GOFLAGS=-mod=mod
# The version the binaries report (kubectl and helm read it from /version).
pkg=k8s.io/component-base/version
ldflags="-s -w -X $pkg.gitVersion=$kube_version -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
ldflags="$ldflags -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"

cd "$here"
start=$SECONDS
go build -trimpath -ldflags "$ldflags" -o "$tmp/bin/" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager ./etcd
echo "controlplane: built kube-apiserver, kube-controller-manager $kube_version and etcd in $((SECONDS - start)) s"

# The Gateway API CRDs come from the module's own config/crd, so the real server validates
# the HTTPRoutes the operator writes against the real schema.
gateway_dir=$(go mod download -json "sigs.k8s.io/gateway-api@$gateway_version" |
    sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
cp "$gateway_dir"/config/crd/standard/*.yaml "$tmp/gateway-api/"
chmod -R u+w "$tmp/gateway-api"
echo "$kube_version" >"$tmp/VERSION"

rm -rf "$dest" && mv "$tmp" "$dest"
