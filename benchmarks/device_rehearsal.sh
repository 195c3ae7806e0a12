#!/usr/bin/env bash
# benchmarks/device_check.sh rehearsed on a machine without a GPU, in an environment shaped like the lent GPU
# machine's (benchmarks/DEVICE.md): Python 3.12, torch 2.11 (its CUDA build, running on the CPU here),
# transformers 5.17 under the carried 5.23, accelerate 1.15, pandas and absl-py (OR-Tools imports them), the
# carried wheels installed with --target and PYTHONPATH, placement_opt editable without its dependencies. What
# breaks there breaks here first, at no device time: the setup, the tests' collection, and the whole suite.
#
#   bash benchmarks/device_rehearsal.sh            # from the repository's root; about 15 minutes, 5 GB in $VENV
#
# VENV (default /tmp/placement_opt_gpu_env) is made once and reused; PYTHON312 names the interpreter (default: the
# first python3.12 found, pyenv's included). The rehearsal runs on a clone of HEAD (committed work only), and
# prints the steps' exit codes and the suite's last line.
set -eu
venv=${VENV:-/tmp/placement_opt_gpu_env}
python312=${PYTHON312:-}
for candidate in python3.12 ~/.pyenv/versions/3.12*/bin/python3.12; do  # a pyenv shim may exist and fail
    [ -z "$python312" ] && "$candidate" --version >/dev/null 2>&1 && python312=$candidate
done
[ -n "$python312" ] || { echo "no Python 3.12 found: set PYTHON312" >&2; exit 2; }
if [ ! -x "$venv/bin/python3" ]; then
    "$python312" -m venv "$venv"
    "$venv/bin/python3" -m pip install -q torch==2.11.0 transformers==5.17.0 accelerate==1.15.0 pandas absl-py numpy \
        networkx safetensors rich click hypothesis pytest pytest-xdist psutil xxhash jinja2 matplotlib
fi
work=$(mktemp -d /tmp/placement_opt_rehearsal.XXXXXX)
trap 'rm -rf "$work"' EXIT
git clone -q "$(git rev-parse --show-toplevel)" "$work/repo"
cd "$work/repo"
PATH="$venv/bin:$PATH" bash benchmarks/device_wheels.sh
PATH="$venv/bin:$PATH" SITE="$work/site" OUT="$work/out" TESTS_S=600 bash benchmarks/device_check.sh setup tests memory decode probe || true
cat "$work/out/setup.txt"
tail -1 "$work/out/cuda_tests.txt"
PATH="$venv/bin:$PATH" PYTHONPATH="$work/site" HYPOTHESIS_PROFILE=ci python3 -m pytest -q -p no:cacheprovider 2>&1 | tail -1
