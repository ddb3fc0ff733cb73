# Sourced by the scripts in this folder: makes sure the project's virtual environment
# exists outside the checkout (so fresh clones share it instead of each holding a
# copy), installs the project into it idempotently, and puts it first on PATH. With the
# `sglang` extra it also applies patches/*.patch to the installed SGLang
# (scripts/patches.sh apply, idempotent).
#
#   FB_EXTRAS         extras to install (default: dev)
#   FAIRBATCHING_ENV  use this environment directory instead of the cache one
#   PYTHON            interpreter to create it with (default: python3; needs >= 3.11)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
extras="${FB_EXTRAS:-dev}"
python_bin="${PYTHON:-python3}"

"$python_bin" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
  echo "error: $python_bin is $("$python_bin" -V 2>&1); Python >= 3.11 is required (set PYTHON=...)" >&2
  exit 2
}

# The environment is keyed by the interpreter version and the dependency pins of the
# selected extras, so it is rebuilt only when those change. Not by the patches:
# scripts/patches.sh apply brings the installed SGLang to the current patches in place
# (it reverts an older applied version first).
env_key="$("$python_bin" - "$repo_root" "$extras" <<'PY'
import hashlib, json, pathlib, sys, tomllib
repo = pathlib.Path(sys.argv[1])
project = tomllib.load(open(repo / "pyproject.toml", "rb"))["project"]
extras = sorted(e for e in sys.argv[2].split(",") if e)
pins = {"base": project.get("dependencies", []),
        "extras": {e: project.get("optional-dependencies", {}).get(e, []) for e in extras}}
digest = hashlib.sha256(json.dumps(pins, sort_keys=True).encode()).hexdigest()[:12]
print(f"py{sys.version_info.major}{sys.version_info.minor}-{'-'.join(extras) or 'base'}-{digest}")
PY
)"
env_dir="${FAIRBATCHING_ENV:-${XDG_CACHE_HOME:-$HOME/.cache}/fairbatching/env-$env_key}"

# pip on this machine prints one "WARNING: Location 'file:///...' is ignored" line per
# package it looks up in its configured local indexes; drop those, keep the rest of
# stderr and pip's exit status.
pip_() {
  local status=0
  { "$@" 2>&1 1>&3 3>&- | { grep -v "^WARNING: Location 'file://[^']*' is ignored" || true; } >&2; } 3>&1 \
    || status=$?
  return "$status"
}

if [ ! -x "$env_dir/bin/python" ]; then
  echo "creating environment $env_dir" >&2
  "$python_bin" -m venv "$env_dir"
  pip_ "$env_dir/bin/python" -m pip install -q --upgrade pip "setuptools>=77" wheel
fi
pip_ "$env_dir/bin/python" -m pip install -q --no-build-isolation -e "$repo_root[$extras]"

export PATH="$env_dir/bin:$PATH"
export FAIRBATCHING_ENV_DIR="$env_dir"
if [[ ",$extras," == *,sglang,* ]]; then
  PYTHON="$env_dir/bin/python" "$repo_root/scripts/patches.sh" apply >&2
fi
cd "$repo_root"
