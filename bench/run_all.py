"""Run every kernel micro-benchmark and collect their tables in bench/results/kernels.md.

    python bench/run_all.py            # from the repository root, on an otherwise idle machine
"""

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
SCRIPTS = ["bench_context_kv.py", "bench_paged_attention.py", "bench_rejection_sample.py",
           "bench_panel_linear.py", "bench_quant_linear.py", "bench_noise.py", "bench_top_k.py"]
TABLES = ["context_kv", "paged_attention", "paged_attention_target", "rejection_sample",
          "rejection_sample_reads", "panel_linear", "quant_linear", "noise", "top_k"]


def main() -> int:
    for script in SCRIPTS:
        print(f"== {script}", flush=True)
        if subprocess.run([sys.executable, str(HERE / script), *sys.argv[1:]]).returncode:
            return 1
    parts = [f"## {name}\n\n{(HERE / 'results' / f'{name}.md').read_text()}" for name in TABLES
             if (HERE / "results" / f"{name}.md").exists()]
    (HERE / "results" / "kernels.md").write_text("# Kernel micro-benchmarks\n\n" + "\n".join(parts))
    print(f"wrote {HERE / 'results' / 'kernels.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
