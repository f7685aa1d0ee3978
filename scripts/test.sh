#!/usr/bin/env bash
# Quickstart command 2: the test suite as CI runs it, in a virtual environment of its own (.venv-test under the
# checkout, made on the first run and reused after), never in the active environment. No sudo: the remote-tier
# tests need the system library libibverbs1 and skip, saying so, without it (CI installs it and sets
# OASIS_REQUIRE_MOONCAKE=1, which makes its absence an error).
# Usage: bash scripts/test.sh   (PYTHON=... picks the interpreter the environment is made from)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${OASIS_TEST_VENV:-.venv-test}"
unset PYTHONPATH  # nothing of the caller's environment leaks in
[ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
# The CPU build of torch: the suite runs the Triton kernels in the interpreter; nothing here needs CUDA.
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install -q --retries 0 --timeout 15 torch --index-url https://download.pytorch.org/whl/cpu
fi
"$PY" -c "import torch; assert not torch.version.cuda, 'a CUDA torch in the test environment'; print('torch', torch.__version__)"
echo "torch==$("$PY" -c 'import torch; print(torch.__version__)')" > "$VENV/constraints.txt"
"$PY" -m pip uninstall -q -y kvpress 2>/dev/null || true  # the second stage's, from an earlier run
# The newest releases the package allows (an earlier run's second stage left older ones), torch as it is.
"$PY" -m pip install -q --upgrade --upgrade-strategy eager -c "$VENV/constraints.txt" -e ".[dev,remote-cpu]"
if [ "${OASIS_REQUIRE_MOONCAKE:-0}" = 1 ]; then
    # The remote-tier tests must run, not skip: the client library and the service executables (in the venv's bin,
    # which is not on PATH here) are found.
    "$PY" -c "from oasis_hf.remote import mooncake_missing; why = mooncake_missing(); assert why is None, why"
fi

run_pytest() {  # pytest's exit code 5 (nothing collected) is a failure here
    set +e
    TRITON_INTERPRET=1 "$PY" -m pytest -m "not gpu" -q "$@"
    local status=$?
    set -e
    if [ "$status" -eq 5 ]; then
        echo "pytest collected no tests" >&2
        return 1
    fi
    return "$status"
}

run_pytest --durations=10

# Again on transformers 5.17, the oldest supported and the GPU machine's, where the kvpress baselines run: the
# tests that touch transformers' model, attention, generation and lm-eval interfaces, with kvpress 0.5.5 (installed
# without its dependency pins: it declares transformers<5.3 but runs on 5.17 with the hook OasisLM adds).
"$PY" -m pip install -q -c "$VENV/constraints.txt" "transformers==5.17.0" "cachetools>=5" "fire" "pandas<3"
"$PY" -m pip install -q --no-deps "kvpress==0.5.5"
"$PY" -c "import transformers; assert transformers.__version__ == '5.17.0', transformers.__version__"
run_pytest tests/test_generate.py tests/eval/test_tasks.py tests/test_decode_graph.py tests/test_speculative.py \
    tests/test_pipelines.py
