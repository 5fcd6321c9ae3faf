"""`monoserve` subcommands of the node side: make-checkpoint, generate (local), replica.

    monoserve make-checkpoint --preset tiny --out ckpt/tiny [--seed 0] [--dtype bf16] [--force]
    monoserve generate --model ckpt/tiny "Once upon a time" [--max-tokens 64] [--tokens]

`generate` runs an engine in this process (the numpy reference engine unless --engine says). Other transports (e.g. a router
address) plug in by adding arguments in `add_generate_arguments` and a branch in
`run_generate`; `generate_local` is the whole local path.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from replicas.presets import PRESETS

DTYPE_CHOICES = ("bf16", "fp16", "fp32")
CONTEXT_TOKENS = 8  # prompt ids the decoder sees first, so the first output token decodes in context


def register(sub) -> None:
    """Add this module's subcommands to the `monoserve` CLI's subparsers."""
    p = sub.add_parser("make-checkpoint", help="write a synthetic Hugging Face checkpoint (real shapes, random weights)",
                       description="Write config.json, generation_config.json, safetensors weights "
                                   "(sharded above 4 GB), tokenizer.json and tokenizer_config.json.")
    p.add_argument("--preset", required=True, metavar="NAME", help="one of: " + ", ".join(PRESETS))
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (created)")
    p.add_argument("--seed", type=_non_negative, default=0, help="RNG seed; same seed => same weights (default 0)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="bf16", help="weight dtype (default bf16)")
    p.add_argument("--force", action="store_true", help="write into a non-empty directory (replaces weights)")
    p.set_defaults(func=run_make_checkpoint)

    p = sub.add_parser("generate", help="stream a completion for a prompt (local reference engine)",
                       description="Generate text for PROMPT and stream it to stdout; tokens/s go to stderr.")
    add_generate_arguments(p)
    p.set_defaults(func=run_generate)

    # `replica` (gRPC replica server) lives in its own module.
    from replicas import cli_replica

    cli_replica.register(sub)


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="prompt text")
    p.add_argument("--model", metavar="DIR", help="checkpoint directory (config, weights, tokenizer); "
                   "required unless --router is given")
    p.add_argument("--router", metavar="ADDR", default=None,
                   help="generate through a running router (host:port) instead of locally")
    p.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default 0 = off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed; same seed => same text")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's EOS ids")
    p.add_argument("--tokens", action="store_true", help="print raw token ids instead of text")
    p.add_argument("--engine", choices=("reference", "monokernel"), default="reference",
                   help="local engine: numpy reference (default) or the CUDA monokernel (GPU + CuPy)")
    p.add_argument("--devices", default="0", help="monokernel: comma-separated GPU ordinals (default 0)")
    p.add_argument("--max-batch", type=int, default=1,
                   help="monokernel: 2..8 builds the batched engine (one GPU; this prompt takes one of its "
                        "slots: a check of that engine, not a speed-up); default 1 = single-sequence engine")


def run_generate(args: argparse.Namespace) -> int:
    if args.router:
        from router.cli_cmds import generate_remote

        return generate_remote(args)
    if not args.model:
        return _fail("give --model DIR (a checkpoint) to generate locally, or --router ADDR")
    return generate_local(args)


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def _devices(text: str) -> list[int]:
    devices = [d.strip() for d in text.split(",") if d.strip()]
    if not devices or not all(d.isdigit() for d in devices):
        raise argparse.ArgumentTypeError(f"--devices must be comma-separated GPU ordinals like 0,1; got {text!r}")
    return [int(d) for d in devices]


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def run_make_checkpoint(args: argparse.Namespace) -> int:
    from replicas.checkpoint import make_checkpoint, preset_config

    if args.preset not in PRESETS:
        return _fail(f"unknown preset {args.preset!r}; presets: {', '.join(PRESETS)}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        return _fail(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not args.force:
        return _fail(f"--out {out} is not empty; pass --force to write into it (its weights are replaced)")
    config = preset_config(args.preset)
    start = time.perf_counter()
    try:
        make_checkpoint(args.preset, out, seed=args.seed, dtype=args.dtype)
    except OSError as e:
        return _fail(f"cannot write {out}: {e}")
    size = sum(f.stat().st_size for f in out.glob("model*.safetensors"))
    print(f"wrote {args.preset} ({config.num_parameters() / 1e6:,.1f} M parameters, {args.dtype}, "
          f"{size / 1e6:,.1f} MB of weights) to {out} in {time.perf_counter() - start:.1f} s")
    return 0


def generate_local(args: argparse.Namespace, out=None, err=None) -> int:
    """Generate with the reference engine in this process, streaming text (or ids) to `out`."""
    from tokenizers import Tokenizer

    from replicas.engine import InvalidRequest, SamplingParams
    from replicas.model import ConfigError
    from replicas.weights import CheckpointError

    out = out or sys.stdout
    err = err or sys.stderr
    model = Path(args.model)
    try:
        params = SamplingParams.parse(max_tokens=args.max_tokens, temperature=args.temperature,
                                      top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                      ignore_eos=args.ignore_eos)
    except InvalidRequest as e:
        return _fail(str(e))
    tokenizer_file = model / "tokenizer.json"
    if not tokenizer_file.is_file():
        return _fail(f"{tokenizer_file} not found: --model must be a checkpoint directory with a tokenizer")
    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
    except Exception as e:  # noqa: BLE001 (tokenizers raises a bare Exception on malformed JSON)
        return _fail(f"{tokenizer_file} is not a valid tokenizer.json: {e}")
    from replicas.cli_replica import EngineUnavailable, make_engine

    try:  # the same engine factory as `monoserve replica`
        engine = make_engine(argparse.Namespace(
            engine=args.engine, model=str(model), max_batch=args.max_batch, devices=_devices(args.devices)))
    except (ConfigError, CheckpointError, EngineUnavailable, argparse.ArgumentTypeError) as e:
        return _fail(str(e))

    prompt_ids = tokenizer.encode(args.prompt).ids
    start = time.perf_counter()
    try:
        generation = engine.generate(prompt_ids, params)
    except InvalidRequest as e:
        return _fail(str(e))
    first_token_at = None
    n = 0

    def timed():
        nonlocal first_token_at, n
        for token in generation:
            first_token_at = first_token_at or time.perf_counter()
            n += 1
            yield token

    try:
        pieces = (f"{t} " for t in timed()) if args.tokens else stream_text(tokenizer, prompt_ids, timed())
        for piece in pieces:
            print(piece, end="", file=out, flush=True)
    except KeyboardInterrupt:
        generation.cancel()
    finally:
        generation.close()
    print(file=out, flush=True)
    _report(err, len(prompt_ids), n, start, first_token_at, generation.finish_reason)
    return 0


def stream_text(tokenizer, prompt_ids: list[int], token_ids) -> Iterator[str]:
    """Decode a stream of token ids into text pieces, never splitting a UTF-8 character.

    The concatenated pieces equal decoding all ids at once (an incomplete character left at the
    very end becomes U+FFFD, as in a full decode).
    """
    from tokenizers.decoders import DecodeStream

    context = list(prompt_ids[-CONTEXT_TOKENS:])
    stream = DecodeStream(ids=context, skip_special_tokens=True)
    ids: list[int] = []
    emitted = ""
    for token in token_ids:
        ids.append(token)
        chunk = stream.step(tokenizer, token)  # None while a character is incomplete
        if chunk:
            emitted += chunk
            yield chunk
    # flush what the stream still holds back
    before = tokenizer.decode(context, skip_special_tokens=True)
    full = tokenizer.decode(context + ids, skip_special_tokens=True)
    text = full[len(before):] if full.startswith(before) else tokenizer.decode(ids, skip_special_tokens=True)
    if text.startswith(emitted) and len(text) > len(emitted):
        yield text[len(emitted):]


def _report(err, prompt_len: int, n: int, start: float, first_token_at: float | None, finish) -> None:
    end = time.perf_counter()
    reason = getattr(finish, "value", finish)
    if n == 0 or first_token_at is None:
        print(f"[{prompt_len} prompt tokens, no tokens generated, finish={reason}]", file=err)
        return
    decode = f"{(n - 1) / (end - first_token_at):.1f} tokens/s decode" if n > 1 else "decode n/a"
    print(f"[{prompt_len} prompt tokens, {n} generated in {end - start:.2f} s: "
          f"{n / (end - start):.1f} tokens/s overall, {decode}, "
          f"first token {1000 * (first_token_at - start):.0f} ms, finish={reason}]", file=err)
