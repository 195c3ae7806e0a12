#!/usr/bin/env bash
# The GPU checks of issues 13 and 15, in the order they matter, each under its own time limit, for a GPU
# machine lent for minutes (benchmarks/DEVICE.md says how to call it and what to carry there).
#
#   bash benchmarks/device_check.sh [STEP ...]      # default: setup decode memory
#
# STEPs, each writing into $OUT (./device_out without it), at most 7 files in all:
#   setup   the carried wheels (.whl/) into $SITE (default /tmp/site), placement_opt itself (editable, no dependencies),
#           and a line of versions and the GPU's name                              -> setup.txt
#   tests   the CUDA-marked tests                                                  -> cuda_tests.txt
#   memory  issue 13: accelerate auto against placement_opt, same max_memory, batch 1 and 16 at each prompt
#           of $PROMPTS (default 512,4096), under the hard cap (cost_accuracy/run.py --gpu-only)
#                                                                                  -> memory.md, memory.log
#   decode  issue 15: accelerate auto against the layer, phased and sublayer plans, the Llama-3.1-8B shape at
#           $BUDGET of cuda:0 (default 10GiB), $STEPS decode steps (default 16) (phases/gpu.py)
#                                                                                  -> decode.md, decode.log
#   moe     issue 15: the same and expert groups, the Mixtral-8x7B shape cut to $MOE_LAYERS layers (default 8)
#           at 24 GiB scaled to them (phases/gpu.py --case mixtral)                -> moe.md (log into decode.log)
#   probe   a decode step's cost at first and second visits of a context (SDPA default and cuDNN attention off),
#           and a layer's KV cache leaving the GPU, as moved and into pinned memory (phases/probe.py, ~20 s)
#                                                                                  -> probe.md
# Time limits per step, in seconds: TESTS_S (180), MEMORY_S (300), DECODE_S (300), MOE_S (300), PROBE_S (90). A step past its limit gets
# SIGINT (its scratch folder is removed; SIGKILL 30 s later) and the next one runs; memory.md and
# decode.md hold every row finished by then, and the logs what the step printed.
# The steps of a call (and of later calls while the machine stays warm) share one checkpoint per model shape and
# the machine's profile, in $BENCH_SHARED (benchmarks/gpu_common.py): the Llama-3.1-8B shape is written once for
# the memory and decode steps. A lent machine is discarded after the session; RM_SHARED=1 removes it at the end.
set -u
out=${OUT:-device_out}
mkdir -p "$out"
export BENCH_SHARED=${BENCH_SHARED:-/tmp/placement_opt_bench_shared}
site=${SITE:-/tmp/site}
[ "${RM_SHARED:-0}" = 1 ] && trap 'rm -rf "$BENCH_SHARED"' EXIT

step_setup() {
    if compgen -G ".whl/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
            .whl/*.whl || return 1
        export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
    fi
    python3 -m pip install -q --no-deps --no-build-isolation -e . || return 1
    python3 - <<'PY' | tee "$out/setup.txt"
import importlib.metadata as md
import torch
import transformers, placement_opt  # a dependency that fails its version check fails here, not in every step
names = ("placement-opt", "torch", "transformers", "accelerate", "ortools", "pydantic", "safetensors")
print(", ".join(f"{n} {md.version(n)}" for n in names))
print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device")
PY
}

has_cuda() {
    python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"
}

step_tests() {
    timeout -s INT -k 30 "${TESTS_S:-180}" python3 -m pytest -q -m cuda -p no:cacheprovider >"$out/cuda_tests.txt" 2>&1
}

step_memory() {
    timeout -s INT -k 30 "${MEMORY_S:-300}" python3 benchmarks/cost_accuracy/run.py --gpu-only --gpu-prompts "${PROMPTS:-512,4096}" \
        --gpu-caps yes --out "$out/memory.md" >"$out/memory.log" 2>&1
}

step_decode() {
    has_cuda || { echo "decode: no CUDA device here; benchmarks/phases/gpu.py --smoke checks the script" >"$out/decode.log"; return 1; }
    timeout -s INT -k 30 "${DECODE_S:-300}" python3 benchmarks/phases/gpu.py --case llama --budget "${BUDGET:-10GiB}" \
        --steps "${STEPS:-16}" --out "$out/decode.md" >"$out/decode.log" 2>&1
}

step_moe() {
    has_cuda || { echo "moe: no CUDA device here; benchmarks/phases/gpu.py --smoke checks the script" >>"$out/decode.log"; return 1; }
    timeout -s INT -k 30 "${MOE_S:-300}" python3 benchmarks/phases/gpu.py --case mixtral --mixtral-layers "${MOE_LAYERS:-8}" \
        --steps "${STEPS:-16}" --out "$out/moe.md" >>"$out/decode.log" 2>&1
}

step_probe() {
    has_cuda || { echo "probe: no CUDA device here; benchmarks/phases/probe.py --smoke checks the script" >"$out/probe.md"; return 1; }
    timeout -s INT -k 30 "${PROBE_S:-90}" python3 benchmarks/phases/probe.py --out "$out/probe.md" >"$out/probe.out" 2>&1
    local rc=$?
    # one file either way: the tables, or what the probe printed before it failed (rows as they ran, the error)
    if [ "$rc" -eq 0 ]; then rm -f "$out/probe.out"; else mv "$out/probe.out" "$out/probe.md"; fi
    return $rc
}

step_segments() {
    has_cuda || { echo "segments: no CUDA device here; benchmarks/cost_accuracy/segments.py --smoke checks the script" >"$out/segments.log"; return 1; }
    # the memory step's profile (its calibrations price the same plans) when this call ran it, else the recorded one
    local profile="$BENCH_SHARED/profile.json"
    [ -f "$profile" ] || profile=benchmarks/phases/h200-host-profile-2.json
    rm -f "$out/segments.jsonl"
    PROFILE="$profile" PYTORCH_CUDA_ALLOC_CONF= timeout -s INT -k 30 "${SEGMENTS_S:-150}" \
        python3 benchmarks/cost_accuracy/segments.py "$out/segments.jsonl" >"$out/segments.log" 2>&1 || return 1
    PROFILE="$profile" PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout -s INT -k 30 "${SEGMENTS_S:-150}" \
        python3 benchmarks/cost_accuracy/segments.py "$out/segments.jsonl" >>"$out/segments.log" 2>&1
}

export PYTHONUNBUFFERED=1
status=0
for step in "${@:-setup decode memory}"; do
    for one in $step; do
        case "$one" in
            setup|tests|memory|decode|moe|probe|segments) ;;
            *) echo "unknown step '$one': setup, tests, memory, decode, moe, probe or segments" >&2; exit 2 ;;
        esac
        started=$SECONDS
        "step_$one"
        rc=$?
        echo "step $one: exit $rc after $((SECONDS - started)) s"
        [ "$rc" -eq 0 ] || status=1
        [ "$one" = setup ] && [ "$rc" -ne 0 ] && exit 1  # nothing else can run without it
    done
done
exit $status
