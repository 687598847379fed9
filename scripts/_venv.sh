# Sourced by demo.sh and test.sh: makes (or reuses) .venv and installs eejax with the given extras.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
# torch==2.13.0 (the `convert` extra) is the CPU build that lies on the project's machines.
# --no-compile: Python compiles a module's bytecode when it is first imported instead of pip
# compiling every installed module now (a fresh .venv then installs in ~40 s instead of ~65 s here).
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-compile -e ".[$1]" 2>&1 \
  | grep -v "is ignored: it is neither a file nor a directory" || true
export PATH="$PWD/.venv/bin:$PATH"
export EEJAX_CACHE="${EEJAX_CACHE:-$PWD/.cache/eejax}"
