# Sourced by tests/gpu_check's shell scripts: REPO (the checkout, which is the draftsmith package), PY (the
# interpreter: $PYTHON, else the checkout's .venv, else python3) and an offline environment (nothing may come from a
# hub at run time).
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
if [[ -n "${PYTHON:-}" ]]; then PY="$PYTHON"
elif [[ -x "$REPO/.venv/bin/python" ]]; then PY="$REPO/.venv/bin/python"
else PY=python3; fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
