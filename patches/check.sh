#!/usr/bin/env bash
# Check the upstream patches in patches/ against the TRL release they target.
#
#   1. download the trl sdist from the package registry and unpack it;
#   2. `git apply --check` then `git apply` every patches/NNNN-*.patch, in order;
#   3. build a separate virtual environment: torch (pinned by constraints.txt), the *patched* TRL, and trl-ext[test];
#   4. run the tests each patch adds to TRL (TRL's own style, e.g. tests/test_dpo_padding_free.py), then the project's
#      equivalence tests against the patched TRL with the native flags: `TRL_EXT_PATCHED_TRL=1 pytest tests/patches`.
#
# A patch that no longer applies, or whose tests fail, fails the script with a message naming the patch.
# Needs python3 (with venv), git and the package registry; nothing else (no Hub access, no GPU).
#
# Environment: PYTHON (default python3), TRL_PATCH_CHECK_DIR (work directory, default a new temporary directory; it is
# emptied first), TRL_PATCH_CHECK_KEEP=1 to keep the work directory afterwards, TRL_PATCH_CHECK_BASE_ENV=DIR to reuse
# the packages of an existing trl-ext[test] environment (torch, trl-ext and the test extras: .ci/run passes its first
# fresh one) instead of installing torch again: the work environment then holds only the patched TRL, which shadows
# that environment's own.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

TRL_VERSION=1.16.0
PYTHON=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1 DS_BUILD_OPS=0 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TQDM_DISABLE=1 \
  PYTHONUNBUFFERED=1

# The equivalence tests of each patch in tests/patches/. Every test file there must be listed here.
declare -A EQUIVALENCE_TESTS=(
  ["0001-dpo-padding-free.patch"]="tests/patches/test_native_padding_free.py"
  ["0002-unwrap-for-generation-exception-safe.patch"]="tests/patches/test_native_generation_context.py"
  ["0003-dpo-precompute-cache-key.patch"]="tests/patches/test_native_precompute_cache.py"
  ["0004-dpo-single-collective-metrics.patch"]="tests/patches/test_native_metrics_sync.py"
  ["0005-bounded-zero3-generation.patch"]="tests/patches/test_native_bounded_generation.py"
  ["0006-dpo-prompt-sharing.patch"]="tests/patches/test_native_prompt_sharing.py"
  ["0007-online-dpo-fused-lm-head.patch"]="tests/patches/test_native_online_fused_lm_head.py"
)

fail() {
  echo "!!! patches/check.sh: $*" >&2
  exit 1
}

command -v git >/dev/null || fail "git is required (git apply)"

WORK=${TRL_PATCH_CHECK_DIR:-$(mktemp -d -t trl-patch-check.XXXXXX)}
rm -rf "$WORK"
mkdir -p "$WORK"
if [[ "${TRL_PATCH_CHECK_KEEP:-0}" != 1 ]]; then
  trap 'rm -rf "$WORK"' EXIT
fi

mapfile -t PATCHES < <(cd patches && ls -1 [0-9][0-9][0-9][0-9]-*.patch | sort)
[[ ${#PATCHES[@]} -gt 0 ]] || fail "no patches/NNNN-*.patch found"
for test_file in tests/patches/test_*.py; do
  listed=0
  for patch in "${!EQUIVALENCE_TESTS[@]}"; do
    [[ " ${EQUIVALENCE_TESTS[$patch]} " == *" $test_file "* ]] && listed=1
  done
  [[ $listed == 1 ]] || fail "$test_file is not mapped to a patch in EQUIVALENCE_TESTS"
done

echo "=== (${SECONDS}s) [1/4] trl==$TRL_VERSION sdist from the package registry, and a virtual environment ==="
BASE_ENV=${TRL_PATCH_CHECK_BASE_ENV:-}
VENV_PYTHON="$WORK/venv/bin/python"
if [[ -n "$BASE_ENV" ]]; then
  [[ -x "$BASE_ENV/bin/python" ]] || fail "TRL_PATCH_CHECK_BASE_ENV=$BASE_ENV is not a virtual environment"
  "$PYTHON" -m venv --without-pip "$WORK/venv"
  base_site=$("$BASE_ENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  site=$("$VENV_PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "import site; site.addsitedir('$base_site')" >"$site/zz_trl_ext_patch_check_base.pth"
  # The base environment's console scripts (torchrun, accelerate, trl-ext, ...), run by this environment's python so
  # that the processes they launch import the patched TRL too.
  for script in "$BASE_ENV"/bin/*; do
    name=${script##*/}
    [[ -f "$script" && ! -e "$WORK/venv/bin/$name" ]] || continue
    head -c 512 "$script" | grep -qF "$BASE_ENV/bin/python" || continue  # a console script of that environment
    printf '#!/bin/sh\nexec "%s" "%s" "$@"\n' "$VENV_PYTHON" "$script" >"$WORK/venv/bin/$name"
    chmod +x "$WORK/venv/bin/$name"
  done
  PIP=("$VENV_PYTHON" -m pip)
else
  "$PYTHON" -m venv "$WORK/venv"
  PIP=("$WORK/venv/bin/pip")
fi
"${PIP[@]}" download -q --no-deps --no-binary :all: "trl==$TRL_VERSION" -d "$WORK/sdist"
tar -xzf "$WORK/sdist/trl-$TRL_VERSION.tar.gz" -C "$WORK"
SRC="$WORK/trl-$TRL_VERSION"
[[ -f "$SRC/trl/trainer/dpo_trainer.py" ]] || fail "unexpected sdist layout in $SRC"

echo "=== (${SECONDS}s) [2/4] apply ${#PATCHES[@]} patch(es) in order ==="
for patch in "${PATCHES[@]}"; do
  if ! (cd "$SRC" && git apply --check "$REPO/patches/$patch"); then
    fail "patch $patch does not apply cleanly to trl==$TRL_VERSION (after the patches before it). Rebase it."
  fi
  (cd "$SRC" && git apply "$REPO/patches/$patch")
  echo "applied $patch"
done

if [[ -n "$BASE_ENV" ]]; then
  echo "=== (${SECONDS}s) [3/4] install the patched TRL over $BASE_ENV (its torch and trl-ext[test]) ==="
else
  echo "=== (${SECONDS}s) [3/4] install torch (constraints.txt), the patched TRL and trl-ext[test] ==="
fi
if [[ -n "$BASE_ENV" ]]; then
  "${PIP[@]}" install -q --no-deps --ignore-installed "$SRC"
else
  "${PIP[@]}" install -q -c constraints.txt torch==2.13.0
  # One resolver run, so the local patched TRL satisfies trl-ext's `trl` requirement instead of a registry release.
  "${PIP[@]}" install -q -c constraints.txt "$SRC" -e ".[test]"
fi
"$VENV_PYTHON" - <<EOF || fail "the patched TRL is not the one installed in $WORK/venv"
import importlib.metadata, torch, trl
assert trl.__version__ == "$TRL_VERSION", trl.__version__
assert trl.__file__.startswith("$WORK/venv/"), trl.__file__
print("trl", trl.__version__, "from", trl.__file__, "| torch", torch.__version__)
EOF

echo "=== (${SECONDS}s) [4/4] tests, per patch ==="
status=0
for patch in "${PATCHES[@]}"; do
  # TRL-style tests the patch adds to TRL's tests/ (run from the patched source tree, like TRL's CI would)
  mapfile -t trl_tests < <(sed -n 's|^+++ b/\(tests/test_.*\.py\)$|\1|p' "patches/$patch")
  if [[ ${#trl_tests[@]} -gt 0 ]]; then
    echo "--- $patch: TRL tests ${trl_tests[*]}"
    if ! (cd "$SRC" && "$VENV_PYTHON" -m pytest -q -p no:cacheprovider "${trl_tests[@]}"); then
      echo "!!! patches/check.sh: the TRL tests added by patch $patch fail on the patched trl==$TRL_VERSION" >&2
      status=1
    fi
  fi
  equivalence=${EQUIVALENCE_TESTS[$patch]:-}
  if [[ -n "$equivalence" ]]; then
    echo "--- $patch: equivalence tests $equivalence"
    # shellcheck disable=SC2086  # a space-separated list of test files
    if ! TRL_EXT_PATCHED_TRL=1 "$VENV_PYTHON" -m pytest -q -p no:cacheprovider $equivalence; then
      echo "!!! patches/check.sh: equivalence tests of patch $patch fail on the patched trl==$TRL_VERSION" >&2
      status=1
    fi
  fi
done

if [[ $status == 0 ]]; then
  echo "=== all ${#PATCHES[@]} patch(es) apply to trl==$TRL_VERSION and pass their tests (${SECONDS}s) ==="
else
  echo "=== patches/check.sh FAILED (${SECONDS}s) ===" >&2
fi
exit $status
