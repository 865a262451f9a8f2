"""The `dsc` command line: compile, generate, inspect (and the commands later layers add).

User errors print one line (`error: ...`) and exit 2, with no traceback; so does a missing
dependency (`error: torch is not installed: pip install torch`). Each command imports what it
needs when it runs: `dsc -h`, `dsc --version` and `dsc inspect` never import torch."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import typer

from dsc.errors import PassError, UserError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="dsc: an ahead-of-time compiler for transformer inference.",
)
# the modules a command imports that are dsc's dependencies (pyproject.toml), each installed by
# `pip install <the same name>`
_DEPENDENCIES = (
    "torch",
    "transformers",
    "safetensors",
    "tokenizers",
    "huggingface_hub",
    "numpy",
    "pydantic",
    "triton",
    "onnx",
    "onnxruntime",
    "onnxscript",
)
# the modules of an optional extra, installed with the extra: `pip install 'dsc[serve]'`
_EXTRAS = {
    "fastapi": "serve",
    "starlette": "serve",
    "uvicorn": "serve",
    "prometheus_client": "serve",
    "openai": "serve",
    "zmq": "serve",
    "msgpack": "serve",
}


def _version(value: bool) -> None:
    if value:
        from dsc import __version__

        typer.echo(f"dsc {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="print dsc's version and exit"
    ),
) -> None:
    """dsc: an ahead-of-time compiler for transformer inference."""


def _fail(msg: str, code: int = 2) -> None:
    typer.echo(f"error: {' '.join(msg.splitlines())}", err=True)  # one line, whatever a file name holds
    raise typer.Exit(code)


class _RichProgress:
    """Renders compile progress: one line per stage, then its wall time, and a bytes bar while
    weights are written. On an interactive terminal, or with `verbose` (then plain lines, no
    bar); otherwise silent, so that a failed compile leaves exactly one line on stderr (the
    error). Every timing is also kept (`timings`) for --timings FILE."""

    def __init__(self, verbose: bool = False):
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = Console(stderr=True)
        self.interactive = self.console.is_terminal
        self.quiet = not (self.interactive or verbose)
        self.bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        )
        self.task = None
        self.timings: list[tuple[str, float]] = []

    def stage(self, name: str) -> None:
        if not self.quiet:
            self.console.print(f"[bold]{name}[/bold]", highlight=False)

    def timing(self, name: str, seconds: float) -> None:
        self.timings.append((name, seconds))
        if not self.quiet:
            self.console.print(f"  {seconds:7.1f} s  {name}", highlight=False)

    def start_bytes(self, total: int) -> None:
        if not self.interactive:
            return
        self.bar.start()
        self.task = self.bar.add_task("writing rank files", total=total)

    def advance_bytes(self, n: int) -> None:
        if self.task is not None:
            self.bar.update(self.task, advance=n)

    def close(self) -> None:
        if self.task is not None:
            self.bar.stop()
            self.task = None

    def write_timings(self, path: Path) -> None:
        """Stage wall times in order, then the emit's parts ("emit.<part>", summed over tensors)."""
        stages = [(n, s) for n, s in self.timings if not n.startswith("emit.")]
        doc = {
            "stages": [{"name": n, "seconds": round(s, 3)} for n, s in stages],
            "emit_parts": [
                {"name": n.removeprefix("emit."), "seconds": round(s, 3)}
                for n, s in self.timings
                if n.startswith("emit.")
            ],
            "total_seconds": round(sum(s for _, s in stages), 3),
        }
        path.write_text(json.dumps(doc, indent=1) + "\n")


@app.command("compile")
def compile_cmd(
    model: str = typer.Argument(..., help="checkpoint folder, a .gguf file, or a hub id in the local HF cache"),
    out: Path = typer.Option(..., "-o", "--out", help="artifact folder to write"),
    dtype: str | None = typer.Option(None, help="fp16 | bf16 | fp32 (default: the checkpoint's)"),
    tp: int | None = typer.Option(None, "--tp", help="tensor-parallel ranks"),
    ep: int | None = typer.Option(
        None,
        "--ep",
        help="expert-parallel ranks (mixtures of experts): whole experts per rank, the rest tensor-parallel over the "
        "same ranks",
    ),
    max_batch: int | None = typer.Option(None, help="largest batch (KV-cache rows); default 8"),
    max_seq: int | None = typer.Option(
        None, help="longest sequence, prompt + generated; default 512 (or max_position_embeddings, if smaller)"
    ),
    block_size: int | None = typer.Option(
        None, "--block-size", help="tokens per paged KV-cache block: 16 (default) | 32"
    ),
    config: Path | None = typer.Option(None, "--config", help="dsc or DeepSpeed inference config (JSON)"),
    dump_passes: Path | None = typer.Option(None, help="write the graph after every pass here"),
    check_passes: bool = typer.Option(
        False, "--check-passes", help="check each pass's contracts before and after it (docs/passes.md)"
    ),
    verify: bool = typer.Option(False, "--verify", help="compare with transformers on sample prompts"),
    fuse: bool | None = typer.Option(None, "--fuse/--no-fuse", help="run the fusion passes (default on)"),
    int8: bool | None = typer.Option(None, "--int8", help="int8 weights (weight-only, per-channel, symmetric)"),
    fp8: bool | None = typer.Option(
        None, "--fp8", help="fp8 (e4m3) weights per channel and activations per token (FP8 tensor cores)"
    ),
    int4: bool | None = typer.Option(None, "--int4", help="4-bit weights in groups, 16-bit activations (W4A16)"),
    int4_group_size: int | None = typer.Option(
        None,
        "--int4-group-size",
        help="input features per int4 scale group, a multiple of 32 (default per layer: 32 for a GGUF file's 4-bit "
        "blocks, else the largest of 128, 64, 32 dividing it)",
    ),
    auto_precision: float | None = typer.Option(
        None,
        "--auto-precision",
        help="int4, int8 or 16-bit per linear layer: the cheapest keeping the logits SQNR (dB) at or above this",
    ),
    int8_mode: str | None = typer.Option(None, "--int8-mode", help="w8a16 (default) | w8a8"),
    int8_group_size: int | None = typer.Option(None, "--int8-group-size", help="scale per N input channels"),
    int8_q_groups: int | None = typer.Option(
        None, "--int8-q-groups", help="DeepSpeed q_groups: scale groups per weight matrix"
    ),
    int8_asymmetric: bool | None = typer.Option(None, "--int8-asymmetric", help="zero points"),
    int8_lm_head: bool | None = typer.Option(None, "--int8-lm-head", help="also quantize lm_head"),
    int8_skip: list[str] = typer.Option([], "--int8-skip", help="module path pattern kept in 16-bit (repeatable)"),
    int8_min_sqnr: float | None = typer.Option(None, "--int8-min-sqnr", help="fail below this logits SQNR (dB)"),
    calibrate: Path | None = typer.Option(None, "--calibrate", help="calibration prompts, one per line (SmoothQuant)"),
    decode_buckets: str | None = typer.Option(None, "--decode-buckets", help="CUDA-graph batch buckets, e.g. 1,2,4,8"),
    min_tokens: int | None = typer.Option(
        None,
        "--min-tokens",
        help="default min_tokens of requests: tokens generated before eos or a stop token can end one (default 0)",
    ),
    pooling: str | None = typer.Option(
        None,
        "--pooling",
        help="encoders: mean | cls | last (default: the checkpoint's sentence-transformers config, else cls)",
    ),
    target: list[str] = typer.Option(
        [],
        "--target",
        help="GPU arch to compile the kernels for, into the artifact: sm_80 | sm_86 | sm_89 | sm_90 (repeatable; no "
        "GPU needed)",
    ),
    verbose: bool = typer.Option(
        False, "-v", "--verbose", help="print stages and their times also when stderr is not a terminal"
    ),
    timings: Path | None = typer.Option(
        None, "--timings", help="write the stage times here (JSON); the artifact never holds them"
    ),
) -> None:
    """Compile a Hugging Face causal LM or encoder (embedding) model into a dsc artifact."""
    # torch's CPU allocator: 2 MB pages for tensors of 2 MB and more. The compile allocates and
    # frees weight-sized temporaries all along (slices, fp32 copies, int8 parts); on 4 KB pages
    # the kernel faults and zeroes each page of each one, which took most of the quantizing time.
    # Read once, when torch allocates its first tensor: set here, before this command imports it.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    from dsc.compiler import compile as dsc_compile

    if timings is not None and not timings.parent.is_dir():
        _fail(f"--timings: {timings.parent} is not a folder")
    progress = _RichProgress(verbose)
    try:
        path = dsc_compile(
            model,
            out,
            config_file=config,
            dump_passes=dump_passes,
            check_passes=check_passes,
            verify=verify,
            command=["dsc"] + sys.argv[1:],
            progress=progress,
            dtype=dtype,
            tp=tp,
            ep=ep,
            max_batch=max_batch,
            max_seq=max_seq,
            block_size=block_size,
            fuse=fuse,
            int8=int8,
            fp8=fp8,
            int4=int4,
            int4_group_size=int4_group_size,
            auto_precision=auto_precision,
            int8_mode=int8_mode,
            int8_group_size=int8_group_size,
            int8_q_groups=int8_q_groups,
            int8_asymmetric=int8_asymmetric,
            int8_lm_head=int8_lm_head,
            int8_skip=tuple(int8_skip) or None,
            int8_min_sqnr=int8_min_sqnr,
            calibrate=str(calibrate) if calibrate else None,
            decode_buckets=_parse_buckets(decode_buckets),
            min_tokens=min_tokens,
            pooling=pooling,
            targets=tuple(target) or None,
        )
    except UserError as e:
        progress.close()
        _fail(str(e))
    except PassError as e:
        progress.close()
        _fail(str(e), 3)
    progress.close()
    if timings is not None:
        progress.write_timings(timings)
    typer.echo(f"wrote {path}")


def _parse_buckets(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(t) for t in text.replace(",", " ").split())
    except ValueError:
        raise UserError(f"--decode-buckets: expected integers like 1,2,4,8, got {text!r}") from None


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise UserError(f"--token-ids: expected integers separated by commas or spaces, got {text!r}") from None


def _tokenizer(art):
    tok = art.tokenizer()
    if tok is None:
        raise UserError(f"{art.path}: the artifact has no tokenizer; pass --token-ids")
    return tok


_REQUIRE_SIGNATURE_HELP = (
    "public key file (from `dsc keygen`): refuse the artifact unless `dsc sign` signed "
    "it with the matching key (its kernel binaries are then used)"
)
_TRUST_KERNELS_HELP = (
    "use the artifact's kernel binaries (`dsc compile --target`) without a signature: GPU code from the artifact runs"
)
_OFFLOAD_HELP = (
    "cpu | disk: stream the layers beyond --gpu-memory to the device at every step, from pinned host "
    "memory or from the rank file (ZeRO-Inference's offload)"
)
_GPU_MEMORY_HELP = "GiB of weights kept on the device with --offload (default: only those outside the layers)"
_PP_HELP = (
    "pipeline stages of consecutive layers, each on its own tp ranks (tp x N ranks in all; dsc starts "
    "them, or run under torchrun)"
)


@app.command("generate")
def generate_cmd(
    artifact: Path = typer.Argument(..., help="artifact folder"),
    prompt: list[str] = typer.Option([], "--prompt", help="prompt text (repeat for several)"),
    token_ids: list[str] = typer.Option([], "--token-ids", help="prompt as token ids '1,2,3' (repeatable)"),
    max_new_tokens: int = typer.Option(32, help="tokens to generate per prompt"),
    temperature: float = typer.Option(0.0, help="0 = greedy"),
    top_k: int = typer.Option(0, help="sample from the k most likely tokens (0: all)"),
    top_p: float = typer.Option(1.0, help="sample from the smallest set of tokens whose probability reaches p"),
    seed: int | None = typer.Option(None, help="seed of the sampler (prompt i uses seed + i; default 0)"),
    stop_token: list[int] = typer.Option(
        [], "--stop-token", help="token id that ends a sequence (repeatable; default: eos)"
    ),
    stop: list[str] = typer.Option([], "--stop", help="text that ends a sequence, left out of the output (repeatable)"),
    device: str | None = typer.Option(None, help="cpu | cuda (default: cuda if available)"),
    stream: bool = typer.Option(False, "--stream", help="print text as it is generated"),
    as_json: bool = typer.Option(False, "--json", help="one JSON line per prompt: tokens, text, finish reason"),
    kv_cache_memory: float | None = typer.Option(
        None,
        "--kv-cache-memory",
        help="GiB of paged KV cache (default: 90%% of free GPU memory; on CPU the static cache's size)",
    ),
    max_num_seqs: int = typer.Option(256, "--max-num-seqs", help="sequences decoded at once"),
    max_num_batched_tokens: int = typer.Option(
        2048, "--max-num-batched-tokens", help="tokens per step (prompt chunks + decodes)"
    ),
    no_verify: bool = typer.Option(False, "--no-verify", help="skip checksum verification at load"),
    require_signature: Path | None = typer.Option(None, "--require-signature", help=_REQUIRE_SIGNATURE_HELP),
    trust_kernels: bool = typer.Option(False, "--trust-kernels", help=_TRUST_KERNELS_HELP),
    offload: str | None = typer.Option(None, "--offload", help=_OFFLOAD_HELP),
    gpu_memory: float | None = typer.Option(None, "--gpu-memory", help=_GPU_MEMORY_HELP),
    pipeline_parallel_size: int = typer.Option(1, "--pipeline-parallel-size", "--pp", help=_PP_HELP),
) -> None:
    """Generate text from an artifact (continuous batching: any number of prompts). For tp > 1,
    run under torchrun, or let dsc start the ranks."""
    try:
        if not prompt and not token_ids:
            raise UserError("generate: give --prompt TEXT or --token-ids IDS")
        from dsc.runtime.artifact import open_artifact
        from dsc.runtime.sampling import check_sampling

        check_sampling(temperature, top_k, top_p, max_new_tokens, seed)
        from dsc.runtime.offload import check_offload
        from dsc.runtime.pipeline import check_pipeline_parallel_size

        check_offload(offload, gpu_memory)
        check_pipeline_parallel_size(pipeline_parallel_size)
        # plan and tokenizer checked (and verified) before the tokenizer is parsed
        art = open_artifact(artifact, ranks=[], verify=not no_verify, require_signature=require_signature)
        from dsc.runtime.pipeline import check_stages

        check_stages(art.plan, pipeline_parallel_size, str(artifact))
        if art.tp * pipeline_parallel_size > 1 and "WORLD_SIZE" not in os.environ:
            _relaunch_under_torchrun(art.tp * pipeline_parallel_size)
            return
        if prompt:
            _tokenizer(art)
        prompts = list(prompt) + [_parse_ids(t) for t in token_ids]
        vocab = art.plan["model"]["vocab_size"]
        from dsc.runtime.checks import check_token_ids

        check_token_ids(stop_token, vocab, "--stop-token: stop token")
        from dsc.runtime.llm import LLM, SamplingParams

        llm = LLM(
            artifact,
            device=device,
            verify=not no_verify,
            require_signature=require_signature,
            trust_kernels=trust_kernels,
            kv_cache_memory=kv_cache_memory,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            offload=offload,
            gpu_memory=gpu_memory,
            pipeline_parallel_size=pipeline_parallel_size,
        )
        leader = llm.engine.engine.rank == 0
        base = 0 if seed is None else seed
        params = [
            SamplingParams(
                max_tokens=max_new_tokens,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                seed=(base + i) % 2**63,
                stop=list(stop) or None,
                stop_token_ids=list(stop_token) or None,
                ignore_eos=bool(stop_token),
            )
            for i in range(len(prompts))
        ]
        shown: dict[str, int] = {}

        def on_output(out):
            if not (stream and leader and not as_json):
                return
            text = out.outputs[0].text
            new = text[shown.get(out.request_id, 0) :]
            shown[out.request_id] = len(text)
            if len(prompts) > 1:
                if new:
                    typer.echo(f"[{out.request_id}] {new}")
            else:
                sys.stdout.write(new)
                sys.stdout.flush()

        outs = llm.generate(prompts, params, callback=on_output)
        if leader:
            for i, o in enumerate(outs):
                c = o.outputs[0]
                text = c.text if llm.engine.tokenizer is not None else None
                if as_json:
                    typer.echo(
                        json.dumps(
                            {
                                "prompt": i,
                                "tokens": c.token_ids,
                                "finish": c.finish_reason,
                                **({"text": text} if text is not None else {}),
                            }
                        )
                    )
                elif stream and len(prompts) == 1:
                    typer.echo("")
                else:
                    shown_text = text if text is not None else " ".join(map(str, c.token_ids))
                    typer.echo(f"[{i}] {shown_text}" if len(prompts) > 1 else shown_text)
        if llm.engine.engine.world > 1:
            sys.stdout.flush()
            from dsc.runtime.distributed import shutdown_process_group

            shutdown_process_group()
    except UserError as e:
        _fail(str(e))


def _relaunch_under_torchrun(n: int) -> None:
    """Start n local ranks of this same command with torch.distributed.run."""
    import subprocess

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={n}",
        "-m",
        "dsc",
    ] + sys.argv[1:]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    rc = proc.wait()
    if rc:
        raise typer.Exit(rc)


@app.command("inspect")
def inspect_cmd(
    artifact: Path = typer.Argument(..., help="artifact folder"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
    require_signature: Path | None = typer.Option(None, "--require-signature", help=_REQUIRE_SIGNATURE_HELP),
    offload: str | None = typer.Option(
        None, "--offload", help="show where the weights would live under --offload cpu|disk"
    ),
    gpu_memory: float | None = typer.Option(None, "--gpu-memory", help=_GPU_MEMORY_HELP),
    pipeline_parallel_size: int = typer.Option(
        1, "--pipeline-parallel-size", "--pp", help="show where N pipeline stages would cut the layers"
    ),
) -> None:
    """Show an artifact: options, programs and their op counts, kernels, weights and bytes per rank."""
    try:
        from dsc.runtime.inspect import describe, render

        info = describe(
            artifact,
            require_signature=require_signature,
            offload=offload,
            gpu_memory=gpu_memory,
            pipeline_parallel_size=pipeline_parallel_size,
        )
    except UserError as e:
        _fail(str(e))
    if as_json:
        typer.echo(json.dumps(info, indent=1, sort_keys=True))
    else:
        render(info)


@app.command("keygen")
def keygen_cmd(
    private_key: Path = typer.Argument(
        ..., help="where to write the private key; the public key goes to PRIVATE_KEY.pub"
    ),
) -> None:
    """Make an ed25519 key pair for `dsc sign` (private) and `--require-signature` (public)."""
    try:
        from dsc.runtime.signature import keygen

        priv, pub = keygen(private_key)
    except UserError as e:
        _fail(str(e))
    typer.echo(f"wrote {priv} (private: keep it secret) and {pub} (public: give it to whoever loads your artifacts)")


@app.command("sign")
def sign_cmd(
    artifact: Path = typer.Argument(..., help="artifact folder"),
    key: Path = typer.Option(..., "--key", help="private key file from `dsc keygen`"),
) -> None:
    """Sign an artifact (ed25519 over its manifest, which holds every file's sha256); writes
    signature.json beside manifest.json. Checks the artifact's files first."""
    try:
        from dsc.runtime.artifact import sign

        out = sign(artifact, key)
    except UserError as e:
        _fail(str(e))
    typer.echo(f"wrote {out}")


@app.command("bench")
def bench_cmd(
    artifact: Path = typer.Argument(..., help="artifact folder"),
    device: str | None = typer.Option(None, help="cpu | cuda"),
    batch: list[int] = typer.Option([1, 8, 32, 64], "--batch", help="decode batch sizes (repeatable)"),
    prefill: list[int] = typer.Option([128, 2048], "--prefill", help="prefill lengths (repeatable)"),
    context: int = typer.Option(128, help="tokens already in the cache when decode is timed"),
    iters: int = typer.Option(50, help="timed decode steps per batch size"),
    no_cuda_graphs: bool = typer.Option(False, "--no-cuda-graphs", help="eager decode steps"),
    trust_kernels: bool = typer.Option(False, "--trust-kernels", help=_TRUST_KERNELS_HELP),
    as_json: Path | None = typer.Option(None, "--json", help="also write results here"),
    profile: bool = typer.Option(
        False,
        "--profile",
        help="also profile decode steps at the smallest batch: "
        "time per kernel, time between kernels, bandwidth per plan node",
    ),
) -> None:
    """Time an artifact: load + capture, decode per batch, prefill, bandwidth, memory."""
    from dsc.runtime.bench import bench, render

    try:
        from dsc.runtime.artifact import open_artifact

        if open_artifact(artifact, ranks=[], verify=False).tp > 1 and "WORLD_SIZE" not in os.environ:
            _relaunch_under_torchrun(open_artifact(artifact, ranks=[], verify=False).tp)
            return
        res = bench(
            artifact,
            device=device,
            batches=batch,
            prefill_lens=prefill,
            context=context,
            iters=iters,
            cuda_graphs=not no_cuda_graphs,
            profile=profile,
            trust_kernels=trust_kernels,
        )
    except UserError as e:
        _fail(str(e))
    if res.get("tp", 1) > 1:
        sys.stdout.flush()
        from dsc.runtime.distributed import shutdown_process_group

        shutdown_process_group()
    if res.get("rank", 0) != 0:
        return
    typer.echo(render(res))
    if as_json:
        as_json.write_text(json.dumps(res, indent=1, sort_keys=True, default=str) + "\n")


@app.command("diff")
def diff_cmd(
    a: Path = typer.Argument(..., help="artifact or pass-dump folder (DIR/NN_pass); the reference"),
    b: Path = typer.Argument(..., help="artifact or pass-dump folder to compare with A"),
    as_json: bool = typer.Option(False, "--json", help="machine-readable output"),
    numeric: bool = typer.Option(False, "--numeric", help="run both artifacts and compare every shared node's output"),
    token_ids: list[str] = typer.Option([], "--token-ids", help="(--numeric) prompt as token ids '1,2,3' (repeatable)"),
    seed: int = typer.Option(0, help="(--numeric) seed of the random prompt used without --token-ids"),
    length: int = typer.Option(8, help="(--numeric) tokens in the random prompt"),
    program: str = typer.Option("prefill", help="(--numeric) prefill | decode (one step after a prefill)"),
    sqnr_threshold: float = typer.Option(30.0, "--sqnr-threshold", help="(--numeric) divergence below this SQNR (dB)"),
    top: int | None = typer.Option(None, "--top", help="(--numeric) show only the N nodes of lowest SQNR"),
) -> None:
    """What changed between two artifacts or pass dumps. Exit 0: identical (--numeric: no node
    below the threshold), 1: different, 2: error."""
    try:
        if numeric:
            from dsc.compiler.numerics import numeric_diff, render

            prompts = [_parse_ids(t) for t in token_ids] or None
            res = numeric_diff(a, b, prompts, program=program, threshold=sqnr_threshold, seed=seed, length=length)
            same = res["first_divergent"] is None
        else:
            from dsc.compiler.diff import diff, render

            res = diff(a, b)
            same = res["identical"]
    except UserError as e:
        _fail(str(e))
    if as_json:
        typer.echo(json.dumps(res, indent=1, sort_keys=True))
    elif numeric:
        render(res, top=top)
    else:
        render(res)
    raise typer.Exit(0 if same else 1)


@app.command("eval")
def eval_cmd(
    artifact: Path = typer.Argument(..., help="artifact folder"),
    text: Path | None = typer.Option(None, "--text", help="UTF-8 text to measure on (default: the built-in sample)"),
    against: str | None = typer.Option(
        None, "--against", help="reference: an artifact, or a checkpoint (folder, hub id, .gguf)"
    ),
    seq: int = typer.Option(128, "--seq", help="tokens per window (at most the artifact's max_seq)"),
    max_tokens: int = typer.Option(1024, "--max-tokens", help="tokens of the text measured"),
    as_json: bool = typer.Option(False, "--json", help="print the measurements as JSON"),
) -> None:
    """Perplexity of the artifact on a text and, with --against, its logits' SQNR, KL and top-1
    agreement with another artifact or the checkpoint."""
    try:
        from dsc.compiler.evaluate import evaluate, summary

        res = evaluate(artifact, text, against, seq=seq, max_tokens=max_tokens)
    except UserError as e:
        _fail(str(e))
    typer.echo(json.dumps(res, indent=1, sort_keys=True) if as_json else summary(res))


@app.command("export-onnx")
def export_onnx_cmd(
    artifact: Path = typer.Argument(..., help="artifact folder"),
    out: Path = typer.Option(..., "-o", "--out", help="folder for rank{i}.onnx"),
    fp32: bool = typer.Option(False, "--fp32", help="compute in float32 (onnxruntime's CPU kernels lack bf16)"),
    check: bool = typer.Option(True, "--check/--no-check", help="run onnx.checker and compare with the dsc runtime"),
    rank: list[int] = typer.Option([], "--rank", help="export only this rank (repeatable; default: every rank)"),
) -> None:
    """Export each rank's prefill program as an ONNX model (standard ops, int8 weights as QDQ).
    The KV cache is an explicit input and output; see docs/artifact.md. Exit 1 when
    onnxruntime's logits miss the stated tolerance against the dsc runtime."""
    try:
        from dsc.compiler.onnx_export import export_onnx, report_lines

        reports = export_onnx(artifact, out, fp32=fp32, check=check, ranks=list(rank) or None)
    except UserError as e:
        _fail(str(e))
    for line in report_lines(reports):
        typer.echo(line)
    if not all(r.get("ok", True) for r in reports):
        _fail("onnxruntime's logits differ from the dsc runtime's beyond the tolerance", 1)


@app.command("serve")
def serve_cmd(
    artifact: Path = typer.Argument(..., help="artifact folder"),
    host: str = typer.Option("127.0.0.1", help="address to listen on (default: this machine only)"),
    port: int = typer.Option(8000, help="TCP port (0: any free port)"),
    max_num_seqs: int = typer.Option(256, "--max-num-seqs", help="sequences the scheduler runs at once"),
    kv_cache_memory: float | None = typer.Option(
        None, "--kv-cache-memory", help="KV-cache pool in GiB (default: the engine's)"
    ),
    max_num_batched_tokens: int = typer.Option(2048, "--max-num-batched-tokens", help="token budget of one step"),
    max_queue: int = typer.Option(1024, "--max-queue", help="requests waiting beyond the running ones; past it: 429"),
    api_key: str | None = typer.Option(
        None, "--api-key", help="require 'Authorization: Bearer KEY' on /v1 (default: $DSC_API_KEY)"
    ),
    served_model_name: str | None = typer.Option(
        None, "--served-model-name", help="the model's name in the API (default: the artifact folder's)"
    ),
    shutdown_timeout: float = typer.Option(
        30.0, "--shutdown-timeout", help="seconds SIGTERM lets requests in flight finish"
    ),
    device: str | None = typer.Option(None, help="cpu | cuda (default: cuda if available)"),
    no_verify: bool = typer.Option(False, "--no-verify", help="skip checksum verification at load"),
    require_signature: Path | None = typer.Option(None, "--require-signature", help=_REQUIRE_SIGNATURE_HELP),
    trust_kernels: bool = typer.Option(False, "--trust-kernels", help=_TRUST_KERNELS_HELP),
    offload: str | None = typer.Option(None, "--offload", help=_OFFLOAD_HELP),
    gpu_memory: float | None = typer.Option(None, "--gpu-memory", help=_GPU_MEMORY_HELP),
    pipeline_parallel_size: int = typer.Option(1, "--pipeline-parallel-size", "--pp", help=_PP_HELP),
) -> None:
    """Serve an artifact over the OpenAI API (completions, chat, models, health, metrics)."""
    try:
        from dsc.serve.server import ServeOptions, serve_artifact  # the serve extra, before the load

        if max_queue < 0 or shutdown_timeout < 0:
            raise UserError(f"--max-queue and --shutdown-timeout: must be >= 0, got {max_queue}, {shutdown_timeout}")
        from dsc import switches
        from dsc.runtime.offload import check_offload
        from dsc.runtime.pipeline import check_pipeline_parallel_size

        check_offload(offload, gpu_memory)
        check_pipeline_parallel_size(pipeline_parallel_size)

        opts = ServeOptions(
            host=host,
            port=port,
            served_model_name=served_model_name,
            api_key=api_key or switches.API_KEY or None,
            max_queue=max_queue,
            shutdown_timeout=shutdown_timeout,
        )
        serve_artifact(
            artifact,
            opts,
            typer.echo,
            device=device,
            kv_cache_memory=kv_cache_memory,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            verify=not no_verify,
            require_signature=str(require_signature) if require_signature else None,
            trust_kernels=trust_kernels,
            offload=offload,
            gpu_memory=gpu_memory,
            pipeline_parallel_size=pipeline_parallel_size,
        )
    except UserError as e:
        _fail(str(e))


@app.command("bench-serve")
def bench_serve_cmd(
    url: str | None = typer.Argument(None, help="the server, e.g. http://127.0.0.1:8000"),
    rate: list[str] = typer.Option(
        ["1", "4", "16", "inf"], "--rate", help="requests per second (repeatable; inf: all at once)"
    ),
    num_requests: int = typer.Option(100, "--num-requests", help="requests per rate"),
    prompt_len: str | None = typer.Option(
        None,
        "--prompt-len",
        help="prompt tokens: N, LO:HI (uniform) or A,B,... (one of); default 128, or half the server's max_model_len",
    ),
    output_len: str | None = typer.Option(
        None, "--output-len", help="output tokens: N, LO:HI or A,B,...; default as --prompt-len"
    ),
    vocab: int | None = typer.Option(
        None, help="prompt token ids are drawn from [10, VOCAB); default: the server's vocab_size"
    ),
    model: str | None = typer.Option(None, help="model name (default: the server's first)"),
    api_key: str | None = typer.Option(None, "--api-key", help="bearer key (default: $DSC_API_KEY)"),
    seed: int = typer.Option(0, help="seed of the workload and the arrivals"),
    as_json: Path | None = typer.Option(None, "--json", help="write the results here"),
    png: Path | None = typer.Option(None, "--png", help="plot latency against throughput here (needs matplotlib)"),
    offline: Path | None = typer.Option(
        None, "--offline", help="also run the same requests through dsc.LLM on this artifact"
    ),
    device: str | None = typer.Option(None, help="(--offline) cpu | cuda"),
) -> None:
    """Load-test an OpenAI-compatible server: Poisson arrivals per rate; throughput, TTFT, ITL, E2E."""
    try:
        from dsc.serve.bench import (
            BenchConfig,
            Lengths,
            check,
            compare_offline,
            plot,
            render,
            run,
            run_offline,
            write_json,
        )

        try:
            rates = [float(r) for r in rate]
        except ValueError:
            raise UserError(f"--rate: expected numbers or inf, got {rate}") from None
        if url is None and offline is None:
            raise UserError("bench-serve: give the server's URL, or --offline ARTIFACT, or both")
        from dsc import switches

        cfg = BenchConfig(
            url or "",
            rates,
            num_requests,
            prompt_len and Lengths.parse(prompt_len, "--prompt-len"),
            output_len and Lengths.parse(output_len, "--output-len"),
            vocab,
            model,
            api_key or switches.API_KEY or "none",
            seed,
        )
        check(cfg)
        res = (
            run(cfg, progress=lambda line: typer.echo(line, err=True))
            if url
            else {"model": offline.name, "results": []}
        )
        if offline is not None:
            typer.echo(f"offline: {num_requests} requests through dsc.LLM({offline})", err=True)
            row, used = run_offline(cfg, offline, device=device)
            res["results"].append(row)
            res.setdefault("config", {"prompt_len": used.prompt_len.spec, "output_len": used.output_len.spec})
            compare_offline(res)
    except UserError as e:
        _fail(str(e))
    typer.echo(render(res), nl=False)
    if as_json:
        write_json(res, as_json)
    if png:
        why = plot(res, png)
        typer.echo(why or f"wrote {png}", err=bool(why))


def main() -> None:
    try:
        app()
    except ModuleNotFoundError as e:  # a dependency a command imports is missing: one line, no traceback
        top = (e.name or "").split(".")[0]
        if top not in _DEPENDENCIES and top not in _EXTRAS:
            raise
        pip = f"'dsc[{_EXTRAS[top]}]'" if top in _EXTRAS else top
        typer.echo(f"error: {top} is not installed: pip install {pip}", err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
