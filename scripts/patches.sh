#!/usr/bin/env bash
# Applies, reverts or checks patches/*.patch against the SGLang installed in the active
# environment (the `python` on PATH, or $PYTHON). Safe to run repeatedly: each patch's
# state is decided with `patch --dry-run` (forward and reverse) before anything changes.
#
#   scripts/patches.sh apply    # apply those not applied yet
#   scripts/patches.sh revert   # undo those applied
#   scripts/patches.sh check    # report; exit 0 only if every patch is applied
#
# A patch edited since it was applied is upgraded in place: `apply` reverts the applied
# version first, found as the copy kept under site-packages/.fairbatching-patches/ when
# it was applied, or else (an installation patched before copies were kept) among the
# patch's versions in this checkout's git history.
#
# Exit status 3 when a patch neither applies nor is already applied, nor is an applied
# older version (another SGLang version, a partly applied patch, or files edited by
# hand); that patch is left alone.
set -euo pipefail

usage() { echo "usage: $0 apply|revert|check" >&2; exit 2; }
[ $# -eq 1 ] || usage
action="$1"
case "$action" in apply|revert|check) ;; *) usage ;; esac

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python_bin="${PYTHON:-python}"
command -v patch >/dev/null || { echo "error: the 'patch' program is not installed" >&2; exit 2; }

site_packages="$("$python_bin" -c 'import importlib.util, os, sys
spec = importlib.util.find_spec("sglang")
if spec is None or not spec.submodule_search_locations:
    sys.exit("error: sglang is not installed in " + sys.prefix)
print(os.path.dirname(list(spec.submodule_search_locations)[0]))')"

shopt -s nullglob
patches=("$repo_root"/patches/*.patch)
[ ${#patches[@]} -gt 0 ] || { echo "no patches in $repo_root/patches" >&2; exit 0; }

# --fuzz=0: a patch must match exactly, so a different SGLang version is refused.
patch_cmd=(patch -p0 -d "$site_packages" --batch --force --fuzz=0 --no-backup-if-mismatch
           --reject-file=-)

state_of() {  # applied | unapplied | conflict
  if "${patch_cmd[@]}" --reverse --dry-run --silent <"$1" >/dev/null 2>&1; then
    echo applied
  elif "${patch_cmd[@]}" --dry-run --silent <"$1" >/dev/null 2>&1; then
    echo unapplied
  else
    echo conflict
  fi
}

record_dir="$site_packages/.fairbatching-patches"

reverts_cleanly() { "${patch_cmd[@]}" --reverse --dry-run --silent <"$1" >/dev/null 2>&1; }

older_applied_version() {  # prints the path of an applied older version of $1, if any
  local name recorded tmp commit
  name="$(basename "$1")"
  recorded="$record_dir/$name"
  if [ -f "$recorded" ] && reverts_cleanly "$recorded"; then
    echo "$recorded"; return 0
  fi
  git -C "$repo_root" rev-parse --git-dir >/dev/null 2>&1 || return 1
  tmp="$(mktemp)"
  for commit in $(git -C "$repo_root" log --format=%H -- "patches/$name"); do
    if git -C "$repo_root" show "$commit:patches/$name" >"$tmp" 2>/dev/null && reverts_cleanly "$tmp"; then
      mkdir -p "$record_dir" && cp "$tmp" "$recorded" && rm -f "$tmp"
      echo "$recorded"; return 0
    fi
  done
  rm -f "$tmp"
  return 1
}

record() { mkdir -p "$record_dir" && cp "$1" "$record_dir/$(basename "$1")"; }

conflict() {
  local version
  version="$("$python_bin" -c 'import importlib.metadata as m; print(m.version("sglang"))' 2>/dev/null || echo unknown)"
  echo "error: $(basename "$1") neither applies to nor is applied in the installed sglang" \
       "$version at $site_packages (the patches target sglang 0.5.23; partly applied, or" \
       "files edited by hand?). Dry run:" >&2
  "${patch_cmd[@]}" --dry-run <"$1" >&2 || true
  exit 3
}

# Patches apply in name order and revert in reverse order.
ordered=("${patches[@]}")
if [ "$action" = revert ]; then
  ordered=()
  for ((i = ${#patches[@]} - 1; i >= 0; i--)); do ordered+=("${patches[$i]}"); done
fi

status=0
for p in "${ordered[@]}"; do
  name="$(basename "$p")"
  state="$(state_of "$p")"
  if [ "$state" = conflict ] && older="$(older_applied_version "$p")"; then
    state=outdated
  fi
  case "$action:$state" in
    *:conflict)       conflict "$p" ;;
    apply:outdated)   "${patch_cmd[@]}" --reverse --silent <"$older"
                      [ "$(state_of "$p")" = unapplied ] || conflict "$p"
                      "${patch_cmd[@]}" --silent <"$p"; record "$p"; echo "upgraded $name" ;;
    apply:unapplied)  "${patch_cmd[@]}" --silent <"$p"; record "$p"; echo "applied $name" ;;
    apply:applied)    record "$p"; echo "already applied $name" ;;
    revert:outdated)  "${patch_cmd[@]}" --reverse --silent <"$older"; rm -f "$older"
                      echo "reverted an older $name" ;;
    revert:applied)   "${patch_cmd[@]}" --reverse --silent <"$p"; rm -f "$record_dir/$name"
                      echo "reverted $name" ;;
    revert:unapplied) echo "not applied $name" ;;
    check:outdated)   echo "an older version of $name is applied (run: $0 apply)"; status=1 ;;
    check:applied)    echo "applied $name" ;;
    check:unapplied)  echo "not applied $name"; status=1 ;;
  esac
done
exit "$status"
