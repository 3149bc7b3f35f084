#!/usr/bin/env bash
# One entry point for newcomers: creates .venv and installs requirements.txt on first use (or when it changes).
#   bash run.sh app    - the Gradio app on the shipped small model, http://127.0.0.1:7860
#   bash run.sh test   - the test suite (extra arguments go to pytest)
set -euo pipefail
cd "$(dirname "$0")"
if [ ! -x .venv/bin/python ] || ! cmp -s requirements.txt .venv/.installed-requirements; then
  python3 -m venv .venv
  .venv/bin/pip install --quiet --disable-pip-version-check -r requirements.txt
  cp requirements.txt .venv/.installed-requirements
fi
export GRADIO_ANALYTICS_ENABLED=False HF_HUB_DISABLE_TELEMETRY=1
case "${1:-}" in
  app) shift; exec .venv/bin/python -m app "$@" ;;
  test) shift; export HF_HUB_OFFLINE=1; exec .venv/bin/python -m pytest "$@" ;;
  *) echo "usage: bash run.sh app|test [args...]" >&2; exit 2 ;;
esac
