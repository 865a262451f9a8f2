"""dsc compiler: checkpoint -> traced programs -> passes -> artifact."""

from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path
from typing import Any

from dsc.compiler.options import CompileOptions, make_options, options_from_config_file
from dsc.errors import UserError


class Progress:
    """What compile reports while it works; the CLI renders it with rich.

    `timing(name, seconds)` follows each stage (`name` as `stage` gave it) and reports parts of
    the emit ("emit.<part>": the source read, each rank's slicing/quantizing and writing, summed
    over the tensors; parts run on two threads, so they may add up to more than the stage)."""

    def stage(self, name: str) -> None: ...
    def timing(self, name: str, seconds: float) -> None: ...
    def start_bytes(self, total: int) -> None: ...
    def advance_bytes(self, n: int) -> None: ...


class _Stages:
    """Starts a named stage (ending the previous one) and reports each one's wall time."""

    def __init__(self, progress: Progress):
        self.progress, self.name, self.t0 = progress, None, 0.0

    def __call__(self, name: str) -> None:
        self.end()
        self.progress.stage(name)
        self.name, self.t0 = name, time.perf_counter()

    def end(self) -> None:
        if self.name is not None:
            self.progress.timing(self.name, time.perf_counter() - self.t0)
            self.name = None


def compile(
    model: Any,
    out: str | Path,
    *,
    options: CompileOptions | None = None,
    config_file: str | Path | None = None,
    dump_passes: str | Path | None = None,
    check_passes: bool = False,
    verify: bool = False,
    command: list[str] | None = None,
    progress: Progress | None = None,
    tokenizer: Any = None,
    **fields: Any,
) -> Path:
    """Compile `model` (a checkpoint folder, a hub id in the local cache, a .gguf file, or a
    loaded transformers model) into an artifact at `out`. Option fields (dtype, tp, max_batch,
    max_seq, ...) may be given as keywords, as a CompileOptions, or through a dsc/DeepSpeed
    JSON config file (keywords win). `tokenizer`: a loaded model's transformers tokenizer, saved
    into the artifact's tokenizer/ as a checkpoint folder's is (a folder brings its own)."""
    # torch-free checks first: bad input fails in a fraction of a second, before any tracing
    from dsc.compiler.architectures import architecture_for
    from dsc.compiler.gguf_source import is_gguf
    from dsc.compiler.source import open_checkpoint
    from dsc.compiler.validate import check_destination, validate_options

    progress = progress or Progress()
    stages = _Stages(progress)
    stages("load")
    if options is None:
        base = options_from_config_file(Path(config_file)) if config_file else {}
        base.update({k: v for k, v in fields.items() if v is not None})
        options = make_options(str(config_file) if config_file else "options", **base)
    elif fields:
        options = options.model_copy(update=fields)
    check_destination(Path(out))
    if verify and options.tp > 1:
        raise UserError(
            "--verify runs the artifact in one process, so it needs --tp 1; compare a tp "
            "artifact with its tp=1 twin with `dsc diff --numeric`"
        )
    with _as_checkpoint(model, tokenizer) as src:
        if is_gguf(model):  # config.json and the tokenizer converted into the temporary folder
            from dsc.compiler.gguf_source import open_gguf

            ckpt = open_gguf(Path(model), src)
        else:
            ckpt = open_checkpoint(src)
        if not isinstance(model, (str, Path)):  # a loaded model: record its name, not the temp folder
            ckpt.name = getattr(model, "name_or_path", "") or type(model).__name__
        arch = architecture_for(ckpt.config, str(ckpt.config_where))
        max_pos = arch.max_positions(ckpt.config)
        if arch.kind == "encoder" and ckpt.gguf is None:  # sentence-transformers' truncation length
            from dsc.compiler.pooling import max_seq_length

            max_pos = min(filter(None, (max_pos, max_seq_length(ckpt.root))), default=None)
        if "max_seq" not in options.model_fields_set and max_pos and max_pos < options.max_seq:
            options = options.model_copy(update={"max_seq": max_pos})  # the default fits the model
        validate_options(ckpt, arch, options)
        from dsc.compiler.emit import emit
        from dsc.compiler.pipeline import run_passes
        from dsc.compiler.trace import target_dtype, trace
        from dsc.compiler.weights import local_dtype, local_shape

        stages("trace")
        m = trace(ckpt, arch, options)
        m = run_passes(m, Path(dump_passes) if dump_passes else None, on_pass=stages, check=check_passes)
        report = None
        if options.int8 or options.fp8 or options.int4 or options.auto_precision is not None:

            def report(folder: Path, weight_sqnr: dict | None) -> dict:
                # measured on the written rank files; a compile below --int8-min-sqnr publishes nothing
                from dsc.compiler.int8_report import check_min_sqnr, int8_report, summary

                stages(
                    "int8 report"
                    if options.int8
                    else "fp8 report"
                    if options.fp8
                    else "int4 report"
                    if options.int4
                    else "quantization report"
                )
                rep = int8_report(m, written=folder, weight_sqnr=weight_sqnr)
                print(summary(rep))
                check_min_sqnr(rep, options.int8_min_sqnr)
                stages("finish")
                return {"int8_report": rep}

        stages("emit")
        dtype = target_dtype(ckpt, options)
        total = 0
        for spec in m.weights.values():
            n = local_dtype(spec).itemsize
            for d in local_shape(spec, options.tp):
                n *= d
            total += n * options.tp
        progress.start_bytes(total)
        out = emit(
            m,
            ckpt,
            Path(out),
            dtype,
            command or ["dsc.compile", str(model if isinstance(model, (str, Path)) else type(model).__name__)],
            on_bytes=progress.advance_bytes,
            before_manifest=report,
            on_timing=progress.timing,
        )
        if verify:
            stages("verify")
            from dsc.compiler.verify import verify_artifact

            vrep = verify_artifact(out, model if ckpt.gguf is not None else ckpt.root)
            print(vrep.summary())
    stages.end()
    return out


@contextlib.contextmanager
def _as_checkpoint(model: Any, tokenizer: Any = None):
    """A path is used as is; a loaded transformers model is saved to a temporary folder, with
    its tokenizer when one is given; a GGUF file gets an empty temporary folder (for its
    converted config and tokenizer)."""
    from dsc.compiler.gguf_source import is_gguf

    if is_gguf(model) and tokenizer is None:
        with tempfile.TemporaryDirectory(prefix="dsc-gguf-") as d:
            yield d
        return
    if isinstance(model, (str, Path)):
        if tokenizer is not None:
            raise UserError(
                f"compile: tokenizer= is for a loaded model; {model} brings the tokenizer files in its folder"
            )
        yield str(model)
        return
    if not hasattr(model, "save_pretrained"):
        raise UserError(f"compile: expected a checkpoint path or a transformers model, got {type(model).__name__}")
    if tokenizer is not None:
        _check_tokenizer(tokenizer, model)
    with tempfile.TemporaryDirectory(prefix="dsc-model-") as d:
        model.save_pretrained(d, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(d)
        yield d


def _check_tokenizer(tokenizer: Any, model: Any) -> None:
    """A transformers tokenizer whose ids fit the model's embedding."""
    if not hasattr(tokenizer, "save_pretrained") or not hasattr(tokenizer, "__len__"):
        raise UserError(
            f"compile: tokenizer= expects a transformers tokenizer (AutoTokenizer.from_pretrained), "
            f"got {type(tokenizer).__name__}"
        )
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(vocab, int) and len(tokenizer) > vocab:
        raise UserError(
            f"compile: tokenizer= has {len(tokenizer)} tokens, more than the model's vocab_size {vocab}: "
            "not this model's tokenizer"
        )


__all__ = ["compile", "CompileOptions", "Progress"]
