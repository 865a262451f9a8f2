"""Every bad input gets one clear line, through the real CLI (`python -m dsc`, a subprocess):
a non-zero exit, exactly one line on stderr naming the file or field, no traceback, and
nothing written at the destination (no -o folder, no temp folder beside it)."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from dsc.compiler.architectures import ARCHITECTURES


def run_dsc(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dsc", *args], capture_output=True, text=True, timeout=300)


def assert_one_line_error(r: subprocess.CompletedProcess, *names: str) -> str:
    assert r.returncode != 0, r.stdout
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    for n in names:
        assert n in lines[0], (n, lines[0])
    return lines[0]


# -- bad checkpoints, bad compile options ---------------------------------------------------


def _edit_config(**changes):
    def mutate(ck: Path):
        cfg = json.loads((ck / "config.json").read_text())
        for k, v in changes.items():
            if v is None:
                cfg.pop(k, None)
            else:
                cfg[k] = v
        (ck / "config.json").write_text(json.dumps(cfg))

    return mutate


def _rewrite_weights(edit):
    """Load model.safetensors, edit the dict of tensors, save it back."""

    def mutate(ck: Path):
        from safetensors.torch import load_file, save_file

        tensors = load_file(ck / "model.safetensors")
        edit(tensors)
        save_file(tensors, ck / "model.safetensors")

    return mutate


def _edit_bytes(edit):
    def mutate(ck: Path):
        f = ck / "model.safetensors"
        f.write_bytes(edit(bytearray(f.read_bytes())))

    return mutate


def _corrupt_header(b: bytearray) -> bytearray:
    b[12:40] = b"\x00\xff" * 14
    return b


_MISSING = "model.layers.1.mlp.up_proj.weight"
_SUPPORTED = ", ".join(sorted(ARCHITECTURES))

# name -> (how to break a copy of the llama-tiny checkpoint, what the error line must name)
CHECKPOINT_CASES = {
    "missing_config": (lambda ck: (ck / "config.json").unlink(), ["config.json"]),
    "malformed_config": (
        lambda ck: (ck / "config.json").write_text('{"model_type": "llama",'),
        ["config.json", "JSON"],
    ),
    "config_not_an_object": (lambda ck: (ck / "config.json").write_text("[1, 2]"), ["config.json"]),
    "config_without_model_type": (_edit_config(model_type=None), ["config.json", "model_type"]),
    "config_without_vocab_size": (_edit_config(vocab_size=None), ["config.json", "vocab_size"]),
    "unknown_model_type": (_edit_config(model_type="mamba"), ["config.json", "'mamba'", _SUPPORTED]),
    "missing_weight_tensor": (_rewrite_weights(lambda t: t.pop(_MISSING)), ["model.safetensors", _MISSING]),
    "weight_of_wrong_shape": (
        _rewrite_weights(lambda t: t.update({_MISSING: t[_MISSING][:-1]})),
        ["model.safetensors", _MISSING, "shape"],
    ),
    "truncated_safetensors": (_edit_bytes(lambda b: b[:-100]), ["model.safetensors", "truncated"]),
    "empty_safetensors": (_edit_bytes(lambda b: b""), ["model.safetensors", "truncated"]),
    "corrupt_header": (_edit_bytes(_corrupt_header), ["model.safetensors", "corrupt"]),
    "header_length_too_big": (
        _edit_bytes(lambda b: struct.pack("<Q", 2**40) + b[8:]),
        ["model.safetensors", "corrupt"],
    ),
    "no_weights": (lambda ck: (ck / "model.safetensors").unlink(), ["model.safetensors"]),
    "index_names_missing_shard": (
        lambda ck: (ck / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {_MISSING: "model-00002-of-00002.safetensors"}})
        ),
        ["model-00002-of-00002.safetensors"],
    ),
    "malformed_index": (
        lambda ck: (ck / "model.safetensors.index.json").write_text("{}"),
        ["model.safetensors.index.json", "weight_map"],
    ),
    "header_is_a_json_list": (
        _edit_bytes(lambda b: struct.pack("<Q", 8) + b"[1, 2]  " + b[8 + struct.unpack("<Q", b[:8])[0] :]),
        ["model.safetensors", "not a JSON object"],
    ),
    "negative_layer_count": (_edit_config(num_hidden_layers=-1), ["config.json", "num_hidden_layers"]),
    "zero_layers": (_edit_config(num_hidden_layers=0), ["config.json", "num_hidden_layers"]),
    "int64_weight": (
        _rewrite_weights(lambda t: t.update({_MISSING: t[_MISSING].long()})),
        ["model.safetensors", _MISSING, "I64"],
    ),
}


@pytest.mark.parametrize("case", list(CHECKPOINT_CASES))
def test_bad_checkpoint(case, tmp_path, make_checkpoint):
    ck = tmp_path / "ckpt"
    shutil.copytree(make_checkpoint("llama-tiny"), ck)
    mutate, names = CHECKPOINT_CASES[case]
    mutate(ck)
    dest = tmp_path / "out"
    dest.mkdir()
    r = run_dsc("compile", str(ck), "-o", str(dest / "art"))
    assert_one_line_error(r, *names)
    assert list(dest.iterdir()) == []


# name -> (extra compile arguments, what the error line must name); on a good checkpoint
OPTION_CASES = {
    "no_such_folder": (None, ["./no/such/checkpoint"]),
    "bad_dtype": (["--dtype", "fp8"], ["dtype", "fp8"]),
    "max_seq_beyond_the_model": (["--max-seq", "5000"], ["--max-seq", "max_position_embeddings", "config.json"]),
    "max_batch_zero": (["--max-batch", "0"], ["max_batch"]),
    "unknown_config_keys": (
        "config:" + json.dumps({"dtype": "fp16", "zero_optimization": {}, "steps": 3}),
        ["ds.json", "steps", "zero_optimization"],
    ),
    "config_not_json": ("config:{dtype: fp16", ["ds.json", "JSON"]),
    "destination_is_a_file": ("dest-file", ["art", "not a dsc artifact"]),
    "deepspeed_num_bits_a_string": (
        "config:" + json.dumps({"quant": {"enabled": True, "weight": {"num_bits": "8"}}}),
        ["ds.json", "quant.weight.num_bits", "'8'"],
    ),
    "deepspeed_q_groups_a_string": (
        "config:" + json.dumps({"quant": {"weight": {"q_groups": "4"}}}),
        ["ds.json", "quant.weight.q_groups"],
    ),
    "deepspeed_tp_size_a_string": ("config:" + json.dumps({"tensor_parallel": {"tp_size": "2"}}), ["ds.json", "tp"]),
}


@pytest.mark.parametrize("case", list(OPTION_CASES))
def test_bad_compile_options(case, tmp_path, make_checkpoint):
    extra, names = OPTION_CASES[case]
    dest = tmp_path / "out"
    dest.mkdir()
    model, args = str(make_checkpoint("llama-tiny")), []
    if extra is None:
        model = "./no/such/checkpoint"
    elif isinstance(extra, list):
        args = extra
    elif extra.startswith("config:"):
        (tmp_path / "ds.json").write_text(extra.removeprefix("config:"))
        args = ["--config", str(tmp_path / "ds.json")]
    elif extra == "dest-file":
        (dest / "art").write_text("precious")
    r = run_dsc("compile", model, "-o", str(dest / "art"), *args)
    assert_one_line_error(r, *names)
    if extra == "dest-file":
        assert [p.name for p in dest.iterdir()] == ["art"] and (dest / "art").read_text() == "precious"
    else:
        assert list(dest.iterdir()) == []


# -- bad artifacts, bad generate requests --------------------------------------------------


@pytest.fixture(scope="module")
def small_artifact(compile_artifact):
    return compile_artifact("llama-tiny", dtype="fp32", max_seq=16, max_batch=2)


def _flip_byte(rel: str):
    def mutate(art: Path):
        f = art / rel
        b = bytearray(f.read_bytes())
        b[len(b) // 2] ^= 0x01
        f.write_bytes(bytes(b))

    return mutate


def _edit_manifest(**changes):
    def mutate(art: Path):
        m = json.loads((art / "manifest.json").read_text())
        m.update(changes)
        (art / "manifest.json").write_text(json.dumps(m))

    return mutate


ARTIFACT_CASES = {
    "flipped_byte_in_rank_file": (_flip_byte("rank0.safetensors"), ["rank0.safetensors", "checksum"]),
    "flipped_byte_in_plan": (_flip_byte("plan.json"), ["plan.json", "checksum"]),
    "other_format_version": (_edit_manifest(format_version=3), ["manifest.json", "format version 3"]),
    "not_an_artifact": (lambda art: (art / "manifest.json").unlink(), ["manifest.json"]),
    "missing_rank_file": (lambda art: (art / "rank0.safetensors").unlink(), ["rank0.safetensors"]),
}


@pytest.mark.parametrize("case", list(ARTIFACT_CASES))
def test_bad_artifact(case, tmp_path, small_artifact):
    art = tmp_path / "art"
    shutil.copytree(small_artifact, art)
    mutate, names = ARTIFACT_CASES[case]
    mutate(art)
    assert_one_line_error(run_dsc("generate", str(art), "--token-ids", "1,2,3"), *names)


GENERATE_CASES = {
    "prompt_longer_than_max_seq": (["--token-ids", ",".join(["5"] * 20)], ["prompt 0", "20 tokens", "max_seq"]),
    "prompt_of_exactly_max_seq": (["--token-ids", ",".join(["5"] * 16)], ["prompt 0", "max_seq"]),
    "text_prompt_longer_than_max_seq": (
        ["--prompt", "the quick brown fox jumps over the lazy dog " * 3],
        ["prompt 0", "max_seq"],
    ),
    "kv_cache_memory_not_positive": (["--token-ids", "1,2", "--kv-cache-memory", "0"], ["--kv-cache-memory", "0"]),
    "kv_cache_memory_below_two_blocks": (
        ["--token-ids", "1,2", "--kv-cache-memory", "0.00001"],
        ["--kv-cache-memory", "KV blocks", "MiB"],
    ),
    "token_ids_not_integers": (["--token-ids", "1,two,3"], ["--token-ids", "1,two,3"]),
    "token_id_outside_vocabulary": (["--token-ids", "1,512"], ["prompt 0", "512", "vocabulary"]),
    "negative_token_id": (["--token-ids", "1,-4"], ["prompt 0", "-4", "vocabulary"]),
    "empty_token_ids": (["--token-ids", ""], ["prompt 0", "empty"]),
    "no_prompt": ([], ["--prompt", "--token-ids"]),
    "negative_top_p": (["--token-ids", "1,2", "--temperature", "1", "--top-p", "-1"], ["top_p", "-1"]),
    "top_p_above_one": (["--token-ids", "1,2", "--top-p", "2"], ["top_p", "2"]),
    "negative_top_k": (["--token-ids", "1,2", "--temperature", "1", "--top-k", "-5"], ["top_k", "-5"]),
    "temperature_nan": (["--token-ids", "1,2", "--temperature", "nan"], ["temperature", "nan"]),
    "negative_temperature": (["--token-ids", "1,2", "--temperature", "-1"], ["temperature", "-1"]),
    "negative_max_new_tokens": (["--token-ids", "1,2", "--max-new-tokens", "-1"], ["max_new_tokens", "-1"]),
    "stop_token_outside_vocabulary": (["--token-ids", "1,2", "--stop-token", "-5"], ["stop token", "-5", "vocabulary"]),
    "cuda_without_a_gpu": (["--token-ids", "1,2", "--device", "cuda"], ["--device", "cuda"]),
    "unknown_device": (["--token-ids", "1,2", "--device", "tpu"], ["--device", "tpu"]),
}


@pytest.mark.parametrize("case", list(GENERATE_CASES))
def test_bad_generate_request(case, small_artifact):
    args, names = GENERATE_CASES[case]
    if case == "cuda_without_a_gpu":
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU")
    assert_one_line_error(run_dsc("generate", str(small_artifact), *args), *names)


def _huge_rank_header(art: Path) -> None:
    f = art / "rank0.safetensors"
    f.write_bytes(struct.pack("<Q", 2**62) + f.read_bytes()[8:])


def _rehash(art: Path) -> None:
    from dsc.runtime.artifact import file_hashes

    m = json.loads((art / "manifest.json").read_text())
    m["files"] = file_hashes(art)
    (art / "manifest.json").write_text(json.dumps(m))


# name -> (how to break a copy of the artifact, the command after `dsc`, what the error line must name)
ARTIFACT_COMMAND_CASES = {
    "corrupt_tokenizer_with_verification": (
        _flip_byte("tokenizer/tokenizer.json"),
        ["generate", "--prompt", "hi"],
        ["tokenizer.json", "checksum"],
    ),
    "corrupt_tokenizer_without_verification": (
        _flip_byte("tokenizer/tokenizer.json"),
        ["generate", "--prompt", "hi", "--no-verify"],
        ["tokenizer.json"],
    ),
    "huge_rank_header_no_verify": (
        _huge_rank_header,
        ["generate", "--token-ids", "1,2", "--no-verify"],
        ["rank0.safetensors", "header length"],
    ),
    "huge_rank_header_inspect": (_huge_rank_header, ["inspect"], ["rank0.safetensors", "header length"]),
    "rank_header_a_json_list_rehashed": (
        lambda art: ((art / "rank0.safetensors").write_bytes(struct.pack("<Q", 8) + b"[1, 2]  "), _rehash(art)),
        ["generate", "--token-ids", "1,2"],
        ["rank0.safetensors", "not a JSON object"],
    ),
    "shape_string_9_pow_9_pow_9_inspect": (
        lambda art: (
            (art / "plan.json").write_text((art / "plan.json").read_text().replace('"batch"', '"9**9**9"', 1)),
            _rehash(art),
        ),
        ["inspect"],
        ["plan.json", "9**9**9"],
    ),
}


@pytest.mark.parametrize("case", list(ARTIFACT_COMMAND_CASES))
def test_bad_artifact_command(case, tmp_path, small_artifact):
    art = tmp_path / "art"
    shutil.copytree(small_artifact, art)
    mutate, command, names = ARTIFACT_COMMAND_CASES[case]
    mutate(art)
    assert_one_line_error(run_dsc(command[0], str(art), *command[1:]), *names)


def test_inspect_of_a_folder_that_is_not_an_artifact(tmp_path):
    assert_one_line_error(run_dsc("inspect", str(tmp_path)), "manifest.json")


@pytest.mark.parametrize(
    "var, value, names",
    [
        ("DSC_GEMV", "fastest", ["DSC_GEMV: must be one of tuned, off, all, got 'fastest'"]),
        ("DSC_ALLREDUCE", "pull", ["DSC_ALLREDUCE: must be one of auto, nccl, got 'pull'"]),
        ("DSC_PDL", "on", ["DSC_PDL: must be one of auto, off, got 'on'"]),
        ("DSC_TUNING", "/nonexistent/rows.json", ["DSC_TUNING: cannot read /nonexistent/rows.json"]),
    ],
)
def test_bad_runtime_switch_is_one_line_at_load(var, value, names, small_artifact, monkeypatch):
    # the kernels read these only on CUDA; load checks them everywhere
    monkeypatch.setenv(var, value)
    assert_one_line_error(run_dsc("generate", str(small_artifact), "--token-ids", "1,2"), *names)


def test_transformers_without_the_attention_interface_for_a_family_is_one_line(tmp_path, make_checkpoint, monkeypatch):
    """A transformers release that builds a family's attention from a class table keyed by
    implementation name (GPT-J before it moved to the attention interface) fails inside
    from_config with KeyError('dsc'): compile names the family, the version and the way out."""
    import transformers

    from dsc.compiler import compile as dsc_compile
    from dsc.errors import UserError

    def from_config(*args, **kwargs):
        raise KeyError("dsc")

    ckpt = make_checkpoint("llama-tiny")
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", from_config)
    with pytest.raises(UserError, match=r"model_type 'llama': transformers \S+ builds its attention"):
        dsc_compile(str(ckpt), tmp_path / "out")
    assert not (tmp_path / "out").exists()
