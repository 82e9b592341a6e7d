"""Rebuild BENCHMARKS.md from its header and the per-area result files in benchmarks/results/.

.venv/bin/python benchmarks/assemble_benchmarks_md.py
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ORDER = [
    "ledger",
    "stream",
    "data_plane",
    "model",
    "engine",
    "mtp_spec",
    "vllm_peer",
    "vllm_backend",
    "trainer",
    "critic",
    "zero_center",
    "sandboxes",
    "admission",
    "job",
    "fidelity",
    "replay_fidelity",
    "gpu",
    "gpu_kernels",
    "gpu_engine",
    "gpu_graphs",
    "gpu_job",
    "gpu_one_h200",
    "gpu_linear_split",
    "gpu_trainer_host",
    "gpu_engine_decode",
    "gpu_bitmap_word",
    "gpu_indexer_select",
    "trainer_step_ops",
    "gpu_trainer_kl",
    "gpu_attention_launch",
    "gpu_decode_split",
    "gpu_walk_registers",
    "kernel_registers",
    "gpu_load_mask",
    "gpu_overlap",
    "gpu_indexer_search",
    "gpu_decode_pairs",
    "gpu_decode_full_batch",
    "indexer_probes",
    "engine_gc_pauses",
    "gpu_trainer_syncs",
    "kernel_instructions",
    "gpu_decode_one_warp",
    "engine_host_step",
    "gpu_host_off_path",
    "gpu_decode_moe",
    "job_ends",
    "gpu_h100_two_sessions",
    "gpu_trunk_graphs",
    "gpu_step_phases",
    "route_payload",
    "gpu_graphed_trainer",
    "gpu_backward_fusions",
    "gpu_step_tail",
    "gpu_indexer_probit",
    "engine_gc_steps",
    "prefill_tile",
    "indexer_stream",
    "gpu_forward_walk",
    "gpu_h200_rows",
    "gpu_router_tile",
    "gpu_pdl",
    "gpu_block_mass",
    "gpu_backward_pairs",
    "gpu_expert_stack",
    "gpu_kept_product",
    "gpu_grad_delivery",
    "ci_time",
]


def main() -> None:
    head = (ROOT / "benchmarks" / "results" / "_header.md").read_text().strip()
    parts = [head]
    for name in ORDER:
        path = ROOT / "benchmarks" / "results" / f"{name}.md"
        if path.exists():
            parts.append(path.read_text().strip())
    (ROOT / "BENCHMARKS.md").write_text("\n\n".join(parts) + "\n")


if __name__ == "__main__":
    main()
