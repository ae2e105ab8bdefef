"""The `dflash` command line: generate, serve, selfcheck (and the demo, bench, train commands)."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys

DEFAULT_TARGET = "smollm2"
# `dflash train`'s answers: a prompt and --max-answer-tokens (a longer cache per sequence only
# costs memory)
ANSWER_MODEL_LEN = 1024


def _at_least(least: int):
    """An argparse type: an integer >= least."""
    def parse(text: str) -> int:
        value = int(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"must be an integer >= {least}, got {text}")
        return value
    parse.__name__ = "integer"   # argparse names the type in its message
    return parse


def _finite(unit: str = "", zero: bool = False):
    """An argparse type: a finite number (of `unit`) > 0 (>= 0 with `zero`)."""
    def parse(text: str) -> float:
        value = float(text)
        if not (0 <= value if zero else 0 < value) or value == float("inf"):
            raise argparse.ArgumentTypeError(
                f"must be a finite number{f' of {unit}' if unit else ''} "
                f"{'>=' if zero else '>'} 0, got {text}")
        return value
    parse.__name__ = unit or "number"
    return parse


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {text}")
    return value


def _counts(text: str) -> list[int]:
    """An argparse type: a comma list of integers >= 1."""
    return [_at_least(1)(x) for x in text.split(",")]


def resolve_target(name: str):
    """'smollm2' = the bundled demo target (fetched through pip on first use), else a path."""
    from . import assets

    return assets.smollm2_target() if name == DEFAULT_TARGET else name


def _target_name(name: str) -> str:
    from pathlib import Path

    return "SmolLM2-135M-Instruct" if name == DEFAULT_TARGET else Path(name).name


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

    from .engine.detokenizer import decode

    def on_tokens(index: int, new: list[int]) -> None:
        if index != 0 or prompt_count != 1 or llm.tokenizer is None:
            return
        tokens.extend(new)
        text = decode(llm.tokenizer, tokens)
        sys.stdout.write(text[printed[0]:])
        sys.stdout.flush()
        printed[0] = len(text)

    return on_tokens


DTYPE_CHOICES = ["auto", "bfloat16", "float16", "float32"]
# models.layers.QUANTIZATIONS, written out: this module imports torch only when a command runs
QUANTIZATION_CHOICES = ["int8", "int4"]
# models.gguf_draft.OUTTYPES, likewise
GGUF_OUTTYPES = ["bf16", "f16", "f32"]
DTYPE_HELP = ("auto (default): the dtype the host's measured costs say decodes fastest; an "
              "explicit dtype is always used")


def add_quantization_arg(p: argparse.ArgumentParser, quantization: str | None = None) -> None:
    """--quantization (default `quantization`; "auto" adds that choice)."""
    p.add_argument("--quantization", default=quantization,
                   choices=QUANTIZATION_CHOICES + (["auto"] if quantization == "auto" else []),
                   help="quantize the target's linear weights on load, per 32 inputs: int8 "
                        "(Q8_0's form) or int4 (Q4_1's)" + (
                            "; auto (default): the bundled target's shipped Q4_1 weights or "
                            "their rounding to the dtype, whichever is expected to decode "
                            "faster" if quantization == "auto" else "; default: none"))


def add_engine_args(p: argparse.ArgumentParser, speculation: bool = True,
                    quantization: str | None = None) -> None:
    """--dtype, --quantization (default `quantization`; "auto" adds that choice),
    --draft-quantization, --recalibrate, and for DFlash engines --speculation."""
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES, help=DTYPE_HELP)
    add_quantization_arg(p, quantization)
    p.add_argument("--draft-quantization", default=None, choices=QUANTIZATION_CHOICES,
                   help="quantize the draft's block weights on load the same way (it only "
                        "proposes: its speed and acceptance move, never the output); "
                        "default: none")
    p.add_argument("--recalibrate", action="store_true",
                   help="measure the engine's cost model again instead of reading its cache")
    if speculation:
        p.add_argument("--speculation", default="adaptive",
                       choices=["adaptive", "chain", "fixed"],
                       help="adaptive (default): each step verifies, per sequence, a tree "
                            "of the draft's best candidates as large as pays on this host (0 = "
                            "none); chain: as many argmax drafts as pay; fixed: full blocks")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--target, --draft and --no-draft (the bundled pair by default)."""
    p.add_argument("--target", default=DEFAULT_TARGET,
                   help="target checkpoint (HF directory or GGUF); default: bundled SmolLM2-135M")
    p.add_argument("--draft", default=None,
                   help="DFlash draft directory; default: the bundled draft for the default target")
    p.add_argument("--no-draft", action="store_true", help="target-only decoding (baseline)")


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=_at_least(1), default=1, metavar="N",
                   help="tensor-parallel ranks for the target (spawned from this process; "
                        "N must divide its KV heads)")


def _generate(args: argparse.Namespace) -> int:
    from .engine import LLM

    prompts = list(args.prompt)
    if args.prompts_file:
        with open(args.prompts_file) as f:
            prompts += [line.rstrip("\n") for line in f if line.strip()]
    if not prompts:
        print("dflash generate: give a prompt or --prompts-file", file=sys.stderr)
        return 2
    params = _sampling_params(args)   # checked before the engine loads
    with LLM(resolve_target(args.target), resolve_draft(args), dtype=args.dtype,
             max_num_seqs=args.max_num_seqs, tp_size=args.tp, speculation=args.speculation,
             recalibrate=args.recalibrate, quantization=args.quantization,
             draft_quantization=args.draft_quantization) as llm:
        return _generate_with(llm, prompts, params, args.chat)


def _generate_with(llm, prompts: list[str], params, chat: bool) -> int:
    if chat:
        prompts = [llm.chat_prompt(p) for p in prompts]
    outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1,
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


def _layer_ids(text: str) -> list[int]:
    """An argparse type: a comma list of layer ids (integers >= 0)."""
    return [_at_least(0)(x) for x in text.split(",")]


_layer_ids.__name__ = "layer id list"   # argparse names the type in its message


def _train(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .engine import LLM
    from .models.loader import read_target_config
    from .train import (
        TrainConfig,
        Trainer,
        check_generation,
        check_options,
        generate_answers,
        load_prompts,
        number_variants,
        read_answers,
    )

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    answers = out / "answers.jsonl"
    prompts = load_prompts(args.prompts)[: args.num_prompts]
    variants = number_variants(prompts, args.number_variants, seed=args.seed)
    # answer rows are indexed into texts; group = the question a row derives from
    texts = prompts + [text for _, text in variants]
    groups = list(range(len(prompts))) + [source for source, _ in variants]
    target = resolve_target(args.target)
    max_model_len = args.max_model_len or \
        min(ANSWER_MODEL_LEN, read_target_config(target).attn.max_position_embeddings)
    llm = LLM(target, dtype=args.dtype, max_num_seqs=args.gen_batch,
              max_model_len=max_model_len, recalibrate=args.recalibrate,
              quantization=args.quantization)
    tc = TrainConfig(num_layers=args.layers, intermediate_size=args.intermediate_size,
                     block_size=args.block_size, mask_token_id=args.mask_token_id,
                     target_layer_ids=args.target_layer_ids, total_steps=args.steps, lr=args.lr,
                     seqs_per_step=args.seqs_per_step, anchors_per_seq=args.anchors_per_seq,
                     seed=args.seed, draft_vocab_size=args.draft_vocab_size,
                     init_from=args.init_from, eval_every=args.eval_every,
                     init_from_target_layers=args.init_from_target_layers,
                     cache_features=not args.no_feature_cache)
    check_options(llm.target, tc)   # before the answers: generating them takes long
    name = args.target if args.target == DEFAULT_TARGET else str(Path(args.target).resolve())
    check_generation(out / "generation.json", {
        "target": name, "dtype": str(llm.dtype), "quantization": args.quantization,
        "max_answer_tokens": args.max_answer_tokens, "max_model_len": llm.max_model_len})
    generate_answers(llm, texts, answers, max_tokens=args.max_answer_tokens,
                     chunk=args.gen_batch * 2)
    if args.only_data:
        return 0
    command = shlex.join(["dflash", *sys.argv[1:]])
    # the answers file may hold more questions than this run's --num-prompts: train on these only
    rows = [dict(r, group=groups[r["index"]]) for r in read_answers(answers)
            if r["index"] < len(texts)]
    Trainer(llm.target, rows, out, tc, target_name=_target_name(args.target),
            command=command).run(max_minutes=args.max_minutes)
    print(f"draft saved to {out / 'draft'}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from . import bench

    bench.run(resolve_target(args.target), resolve_draft(args), args.dataset, args.num_prompts,
              args.concurrency, args.max_tokens, args.temperature,
              args.block_size, args.dtype, args.out, tp_size=args.tp, rounds=args.rounds,
              modes=tuple(args.modes.split(",")), recalibrate=args.recalibrate,
              quantization=args.quantization, draft_quantization=args.draft_quantization)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from . import demo

    demo.run(dtype=args.dtype, max_tokens=args.max_tokens, speculation=args.speculation,
             recalibrate=args.recalibrate, quantization=args.quantization,
             draft_quantization=args.draft_quantization)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from .engine import EngineArgs, LLMEngine

    try:
        from .serve import Server
    except ImportError as e:
        print(f"dflash serve: {e}", file=sys.stderr)
        return 2
    target = resolve_target(args.target)
    engine = LLMEngine(EngineArgs(
        target, resolve_draft(args), dtype=args.dtype, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, speculation=args.speculation,
        recalibrate=args.recalibrate, quantization=args.quantization,
        draft_quantization=args.draft_quantization), isolate_errors=True)
    try:
        if engine.tokenizer is None:
            print("dflash serve: the target has no tokenizer", file=sys.stderr)
            return 2
        server = Server(engine, args.served_model_name or _target_name(args.target),
                        host=args.host, port=args.port, grace_period=args.grace_period,
                        root=str(target),
                        log_level=args.log_level, api_key=args.api_key,
                        max_queue=args.max_queue, max_request_bytes=args.max_request_bytes,
                        stream_timeout=args.stream_timeout, body_timeout=args.body_timeout,
                        trust_request_chat_template=args.trust_request_chat_template,
                        allowed_hosts=tuple(args.allowed_hosts))
        status = server.run()
        if server.stepping:
            # every request has its answer, but the engine thread is still in a step: the
            # interpreter's exit would tear torch down under it (std::terminate, SIGABRT)
            engine.close(kill=True)
            sys.stderr.flush()
            os._exit(status)
        return status
    finally:
        engine.close()


def _selfcheck(args: argparse.Namespace) -> int:
    from .ops import selfcheck

    return 0 if selfcheck.run() else 1


def _export_gguf(args: argparse.Namespace) -> int:
    from .models.gguf_draft import export_draft_gguf

    out = export_draft_gguf(args.draft, args.target, args.output, args.outtype)
    print(f"wrote {out}: run it in llama.cpp with -md {out} --spec-type draft-dflash")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="generate text with DFlash speculative decoding")
    p.add_argument("prompt", nargs="*", help="prompt text(s)")
    add_model_args(p)
    p.add_argument("--prompts-file", help="one prompt per line")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=None)
    add_engine_args(p)
    p.add_argument("--max-num-seqs", type=_at_least(1), default=8)
    add_parallel_args(p)
    p.set_defaults(func=_generate)

    p = sub.add_parser("train", help="train a DFlash draft on the target's own answers "
                                      "(resumable: rerun the same command to continue)")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--prompts", required=True, help="JSONL with a question/prompt/text field")
    p.add_argument("--out", required=True, help="output directory (answers, checkpoint, draft/)")
    p.add_argument("--num-prompts", type=_at_least(1), default=None)
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="the target's dtype for answers and features (match deployment); "
                        + DTYPE_HELP)
    add_quantization_arg(p)
    p.add_argument("--recalibrate", action="store_true",
                   help="with --dtype auto: measure the target's costs again")
    p.add_argument("--gen-batch", type=_at_least(1), default=32,
                   help="sequences decoded together")
    p.add_argument("--number-variants", type=_at_least(0), default=0,
                   help="also answer N copies of each prompt with its numbers re-drawn")
    p.add_argument("--max-answer-tokens", type=_at_least(1), default=384)
    p.add_argument("--max-model-len", type=_at_least(2), default=None,
                   help=f"of the engine that answers (default: {ANSWER_MODEL_LEN}, or the "
                        "target's max_position_embeddings if shorter)")
    p.add_argument("--only-data", action="store_true", help="stop after generating answers")
    p.add_argument("--layers", type=_at_least(1), default=2)
    p.add_argument("--intermediate-size", type=_at_least(1), default=None)
    p.add_argument("--block-size", type=_at_least(2), default=16)
    p.add_argument("--mask-token-id", type=_at_least(0), default=0)
    p.add_argument("--target-layer-ids", type=_layer_ids, default=None,
                   help="comma list; default: docs/design.md 2")
    p.add_argument("--steps", type=_at_least(1), default=4000)
    p.add_argument("--lr", type=_finite(), default=6e-4)
    p.add_argument("--seqs-per-step", type=_at_least(1), default=4)
    p.add_argument("--anchors-per-seq", type=_at_least(1), default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--draft-vocab-size", type=_at_least(0), default=0,
                   help="> 0: the draft proposes only the N most frequent answer tokens "
                        "(with --init-from: the source's if it has N, else this run's)")
    p.add_argument("--max-minutes", type=_finite("minutes"), default=None,
                   help="stop (resumably) after this")
    p.add_argument("--init-from", default=None,
                   help="start from an exported draft's weights (when OUT has no checkpoint)")
    p.add_argument("--init-from-target-layers", type=_layer_ids, default=None,
                   help="comma list: start draft layer i from target layer i of the list")
    p.add_argument("--eval-every", type=_at_least(1), default=250,
                   help="steps between held-out tau")
    p.add_argument("--no-feature-cache", action="store_true",
                   help="run the target on each batch instead of caching its features on "
                        "disk (3.4 KB per token for the bundled pair)")
    p.set_defaults(func=_train)

    p = sub.add_parser("bench", help="DFlash vs target-only throughput on a prompt set")
    p.add_argument("--target", default=DEFAULT_TARGET)
    p.add_argument("--draft", default=None)
    p.add_argument("--dataset", required=True,
                   help="GSM8K-format JSONL path, humaneval, or mt-bench")
    p.add_argument("--num-prompts", type=_at_least(1), default=20)
    p.add_argument("--concurrency", default=[1], type=_counts,
                   help="comma list, e.g. 1,4,16")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--block-size", type=int, default=None)
    add_engine_args(p, speculation=False)
    p.add_argument("--modes", default="adaptive,fixed,target_only",
                   help="comma list of adaptive (DFlash, trees sized per step), chain (DFlash, "
                        "chains sized per step), fixed (DFlash, full blocks), target_only (the "
                        "baseline, required)")
    p.add_argument("--out", default="bench/results", help="where JSON and PNG go")
    p.add_argument("--rounds", type=_at_least(1), default=1,
                   help="repeat the modes of every concurrency, in alternating order; tok/s over "
                        "all rounds (the JSON counts prompts whose tokens were the same in every "
                        "round)")
    add_parallel_args(p)
    p.set_defaults(func=_bench, no_draft=False)

    p = sub.add_parser("demo", help="the bundled SmolLM2 pair on GSM8K-style questions: "
                                     "DFlash vs target-only")
    add_engine_args(p, quantization="auto")
    p.add_argument("--max-tokens", type=int, default=256)
    p.set_defaults(func=_demo)

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, "
                                      "/v1/chat/completions, /metrics)")
    add_model_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8000, help="0 picks a free port (printed)")
    p.add_argument("--max-num-seqs", type=_at_least(1), default=8,
                   help="sequences decoded together")
    p.add_argument("--max-queue", type=_at_least(0), default=256,
                   help="requests waiting beyond max-num-seqs; more get 503 with Retry-After")
    p.add_argument("--max-model-len", type=_at_least(2), default=None,
                   help="longest prompt + output (default min(4096, the models' "
                        "max_position_embeddings))")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients use (default: the target's name)")
    p.add_argument("--api-key", default=os.environ.get("DFLASH_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: the "
                        "DFLASH_API_KEY environment variable, which unlike this flag does not "
                        "show in ps; none if unset)")
    p.add_argument("--allowed-hosts", nargs="*", default=[],
                   help="without an API key, Host header names served besides IP addresses and "
                        "localhost (against DNS rebinding); '*' allows any")
    p.add_argument("--max-request-bytes", type=_at_least(1), default=4 * 2**20,
                   help="larger request bodies get 413 (default 4 MiB)")
    p.add_argument("--stream-timeout", type=_finite("seconds"), default=30.0,
                   help="seconds a stream may wait for a client that does not read before the "
                        "request is aborted and the connection closed (default 30)")
    p.add_argument("--body-timeout", type=_finite("seconds"), default=30.0,
                   help="seconds a request's body may take to arrive; a slower one gets 408 and "
                        "its connection is closed (default 30)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="let requests supply their own chat template (rendered with the "
                        "server's resources: trusted clients only)")
    p.add_argument("--grace-period", type=_finite("seconds", zero=True), default=10.0,
                   help="seconds SIGTERM / Ctrl-C lets running requests finish before they "
                        "are aborted")
    p.add_argument("--log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (info logs every request)")
    add_engine_args(p)
    p.set_defaults(func=_serve)

    p = sub.add_parser("export-gguf", help="write a DFlash draft as llama.cpp's DFlash GGUF "
                       "(run it with --spec-type draft-dflash)")
    p.add_argument("draft", help="the draft's directory (config.json + safetensors)")
    p.add_argument("--target", required=True,
                   help="the target's GGUF file (its tokenizer is copied into the draft)")
    p.add_argument("-o", "--output", required=True, help="the GGUF file to write")
    p.add_argument("--outtype", default="bf16", choices=GGUF_OUTTYPES,
                   help="the matrices' type (vectors are float32)")
    p.set_defaults(func=_export_gguf)

    p = sub.add_parser("selfcheck", help="compare every op's implementation with the reference")
    p.set_defaults(func=_selfcheck)
    return parser


def _log_to_stderr() -> None:
    """The library logs to the `dflash` logger; the command line shows its info messages."""
    logger = logging.getLogger("dflash")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("dflash: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _log_to_stderr()
    try:
        return args.func(args)
    except (ValueError, OSError) as e:   # a bad value or file the command was given
        print(f"dflash {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
