"""The artifact is untrusted data: crafted artifacts whose manifest was re-hashed (so that the
checksums pass) are refused with one UserError line, and run no code, read no file outside the
artifact and never hang; the same holds with verification off and in `dsc inspect`. Signatures
refuse any change after `dsc sign`. Compiles clean up after themselves and publish atomically."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
from artifact_edits import copy_artifact, read_json, rehash, write_json

import dsc
from dsc.errors import UserError
from dsc.runtime.artifact import open_artifact
from dsc.runtime.inspect import describe
from dsc.runtime.memory_plan import eval_dim, parse_dim


@pytest.fixture(scope="module")
def tiny(compile_artifact):
    return compile_artifact("llama-tiny", dtype="fp32", max_seq=16, max_batch=2)


@pytest.fixture
def art(tiny, tmp_path):
    return copy_artifact(tiny, tmp_path / "art")


@contextmanager
def time_limit(seconds: int):
    def hang(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def one_line_error(fn, *names: str) -> str:
    with time_limit(60), pytest.raises(UserError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg, msg
    for n in names:
        assert n in msg, (n, msg)
    return msg


def load(art: Path, **kw):
    return dsc.load(art, device="cpu", cuda_graphs=False, **kw)


def _decode_node(plan: dict, pred) -> dict:
    return next(n for n in plan["programs"]["decode"]["nodes"] if pred(n))


# -- shape strings: parsed, never evaluated -------------------------------------------------


def _escape_payload(marker: Path) -> str:
    # the classic escape from eval(..., {"__builtins__": {}}): reach os.system through a subclass
    return (
        "[c for c in ().__class__.__base__.__subclasses__() if c.__name__ == '_wrap_close'][0]"
        f".__init__.__globals__['system']('touch {marker}')"
    )


@pytest.mark.parametrize("verify", [True, False])
def test_shape_string_runs_no_code(art, tmp_path, verify):
    marker = tmp_path / "pwned"
    plan = read_json(art / "plan.json")
    node = _decode_node(plan, lambda n: n["kind"] == "call" and n.get("dtype") and isinstance(n.get("shape"), list))
    node["shape"] = [_escape_payload(marker), 64]
    write_json(art / "plan.json", plan)
    rehash(art)
    one_line_error(lambda: describe(art), "plan.json", node["name"], "shape")
    one_line_error(lambda: load(art, verify=verify), "plan.json", "shape")
    assert not marker.exists()


def test_shape_power_is_refused_not_evaluated(art):
    plan = read_json(art / "plan.json")
    node = _decode_node(plan, lambda n: n["kind"] == "call" and n.get("dtype") and isinstance(n.get("shape"), list))
    node["shape"] = ["9**9**9", 64]
    write_json(art / "plan.json", plan)
    rehash(art)
    one_line_error(lambda: describe(art), "9**9**9")


@pytest.mark.parametrize(
    "text, sizes, value",
    [
        ("batch", {"batch": 8}, 8),
        ("2*seq + 1", {"seq": 5}, 11),
        ("(batch - 1) // 2 % 3", {"batch": 9}, 1),
        ("-seq + 7", {"seq": 3}, 4),
        ("1823*batch", {"batch": 781}, 1823 * 781),
    ],
)
def test_symbolic_dims_evaluate(text, sizes, value):
    assert eval_dim(text, sizes) == value


@pytest.mark.parametrize(
    "text",
    [
        "9**9**9",
        "__import__('os')",
        "batch.real",
        "f(batch)",
        "1.5*batch",
        "'a'",
        "batch if 1 else 2",
        "[batch]",
        "lambda: 1",
        "x" * 300,
        "",
        "True",
        "2**3",
        "99999999999999999999*batch",
        "1 << 60",
    ],
)
def test_symbolic_dims_refuse_anything_else(text):
    with pytest.raises(ValueError):
        parse_dim(text)


@pytest.mark.parametrize(
    "text, sizes",
    [
        ("seq - 5", {"seq": 1}),
        ("batch // 0", {"batch": 1}),
        ("seq*seq*seq*seq", {"seq": 1 << 20}),
        ("other", {"batch": 1}),
    ],
)
def test_symbolic_dims_out_of_range(text, sizes):
    with pytest.raises(ValueError):
        eval_dim(text, sizes)


# -- the manifest's file list ----------------------------------------------------------------


@pytest.mark.parametrize(
    "entry",
    [
        "tokenizer/../../../../../dev/zero",
        "/etc/passwd",
        "../outside.json",
        "tokenizer/./tokenizer.json",
        "tokenizer//tokenizer.json",
        "a\\..\\b",
        "line\nbreak",
        "manifest.json",
    ],
)
@pytest.mark.parametrize("verify", [True, False])
def test_manifest_paths_outside_the_artifact(art, entry, verify):
    rehash(art, extra={entry: "0" * 64})
    one_line_error(lambda: load(art, verify=verify), "manifest.json", "files")
    one_line_error(lambda: describe(art), "manifest.json", "files")


def test_symlinked_rank_file_is_refused(art, tmp_path):
    outside = tmp_path / "elsewhere.safetensors"
    os.replace(art / "rank0.safetensors", outside)
    (art / "rank0.safetensors").symlink_to(outside)
    rehash(art)  # the link's target hashes as the listed file would
    one_line_error(lambda: load(art, verify=False), "rank0.safetensors", "link")
    one_line_error(lambda: describe(art), "rank0.safetensors", "link")


def test_tokenizer_file_dropped_from_the_list_is_refused(art):
    tok = art / "tokenizer" / "tokenizer.json"
    vocab = read_json(tok)
    vocab["added_tokens"] = []  # a swapped vocabulary
    write_json(tok, vocab)
    rehash(art, drop=("tokenizer/tokenizer.json",))
    one_line_error(lambda: open_artifact(art, ranks=[], verify=True), "tokenizer/tokenizer.json", "not listed")
    one_line_error(lambda: open_artifact(art, ranks=[], verify=False), "tokenizer/tokenizer.json", "not listed")


def test_unlisted_extra_file_is_refused(art):
    rehash(art)
    (art / "tokenizer" / "special_tokens_map.json").write_text("{}")
    one_line_error(lambda: load(art, verify=False), "special_tokens_map.json", "not listed")


def test_listed_file_that_is_missing(art):
    (art / "tokenizer" / "tokenizer_config.json").unlink()
    one_line_error(lambda: load(art), "tokenizer_config.json", "missing")


def test_corrupt_tokenizer_is_caught_by_its_checksum_before_parsing(art):
    tok = art / "tokenizer" / "tokenizer.json"
    tok.write_bytes(tok.read_bytes()[:-50])
    one_line_error(lambda: open_artifact(art, ranks=[], verify=True).tokenizer(), "tokenizer.json", "checksum")
    one_line_error(
        lambda: open_artifact(art, ranks=[], verify=False).tokenizer(), "tokenizer.json", "not a valid tokenizer"
    )


# -- rank-file headers checked against the plan ------------------------------------------------


def _rewrite_rank(art: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(art / "rank0.safetensors")
    edit(tensors)
    save_file(tensors, art / "rank0.safetensors")


def _rename_weight(art: Path, old: str, new: str, in_plan: bool) -> None:
    _rewrite_rank(art, lambda t: t.update({new: t.pop(old)}))
    if in_plan:
        text = (art / "plan.json").read_text()
        write_json(art / "plan.json", json.loads(text.replace(json.dumps(old), json.dumps(new))))


WEIGHT = "model.layers.0.mlp.down_proj.weight"


@pytest.mark.parametrize(
    "new",
    [
        "model.layers.0.mlp.down_proj.weight\nimport os",
        "w'); import os; ('",
        'x"y',
        "a b",
        "model.layers.0.mlp.down_proj.weight\r",
    ],
)
@pytest.mark.parametrize("in_plan", [True, False])
def test_weight_names_with_code_are_refused(art, tmp_path, new, in_plan):
    _rename_weight(art, WEIGHT, new, in_plan)
    rehash(art)
    one_line_error(lambda: load(art, verify=False), "module path" if in_plan else "rank0.safetensors")
    one_line_error(lambda: describe(art))


def test_weight_of_another_shape_than_the_plan(art):
    _rewrite_rank(art, lambda t: t.update({WEIGHT: t[WEIGHT][:, :-1].contiguous()}))
    rehash(art)
    one_line_error(lambda: load(art, verify=False), "rank0.safetensors", WEIGHT, "the plan reads")


def test_weight_of_another_dtype_than_the_plan(art):
    _rewrite_rank(art, lambda t: t.update({WEIGHT: t[WEIGHT].double()}))
    rehash(art)
    one_line_error(lambda: load(art, verify=False), "rank0.safetensors", WEIGHT, "F64")


def _edit_header(art: Path, edit) -> None:
    f = art / "rank0.safetensors"
    b = f.read_bytes()
    (n,) = struct.unpack("<Q", b[:8])
    header = json.loads(b[8 : 8 + n])
    raw = json.dumps(edit(header)).encode()
    raw += b" " * (-len(raw) % 8)
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + b[8 + n :])


def _move_offsets(h: dict) -> dict:
    lo, hi = h[WEIGHT]["data_offsets"]
    h[WEIGHT]["data_offsets"] = [lo + (1 << 30), hi + (1 << 30)]
    return h


HEADER_CASES = {
    "a_json_list": (lambda h: [1, 2], "not a JSON object"),
    "offsets_beyond_the_file": (_move_offsets, "rank0.safetensors"),
    "overlapping_tensors": (lambda h: {**h, "extra.weight": dict(h[WEIGHT])}, "overlaps"),
    "negative_dim": (lambda h: {**h, WEIGHT: {**h[WEIGHT], "shape": [-1, 176]}}, WEIGHT),
    "unknown_dtype": (lambda h: {**h, WEIGHT: {**h[WEIGHT], "dtype": "Q4"}}, WEIGHT),
    "metadata_not_strings": (lambda h: {**h, "__metadata__": {"a": [1]}}, "__metadata__"),
}


@pytest.mark.parametrize("case", list(HEADER_CASES))
def test_corrupt_rank_header(art, case):
    edit, name = HEADER_CASES[case]
    _edit_header(art, edit)
    rehash(art)
    one_line_error(lambda: load(art, verify=False), "rank0.safetensors", name)
    one_line_error(lambda: describe(art), "rank0.safetensors", name)


def test_huge_header_length_is_one_line_in_inspect_and_unverified_load(art):
    f = art / "rank0.safetensors"
    f.write_bytes(struct.pack("<Q", 1 << 62) + f.read_bytes()[8:])
    one_line_error(lambda: describe(art), "rank0.safetensors", "header length")
    one_line_error(lambda: load(art, verify=False), "rank0.safetensors", "header length")


# -- signatures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    from dsc.runtime.signature import keygen

    d = tmp_path_factory.mktemp("keys")
    return keygen(d / "team"), keygen(d / "other")


def test_signed_artifact_loads_and_any_change_is_refused(art, keys):
    from dsc.runtime.artifact import sign

    (priv, pub), (_, other_pub) = keys
    sign(art, priv)
    eng = load(art, require_signature=pub)
    assert eng.generate([[1, 2, 3]], max_new_tokens=2).tokens[0]
    describe(art, require_signature=pub)
    one_line_error(lambda: load(art, require_signature=other_pub), "signature.json", "does not match")
    # an attacker edits the plan and re-hashes the manifest: the signature no longer matches
    plan = read_json(art / "plan.json")
    plan["notes"]["edited"] = True
    write_json(art / "plan.json", plan)
    rehash(art)
    one_line_error(lambda: load(art, require_signature=pub), "signature.json", "does not match")
    one_line_error(lambda: load(art, verify=False, require_signature=pub), "signature.json")


def test_signature_does_not_cover_a_changed_file_without_rehash(art, keys):
    from dsc.runtime.artifact import sign

    (priv, pub), _ = keys
    sign(art, priv)
    tok = art / "tokenizer" / "tokenizer_config.json"
    tok.write_text(tok.read_text() + " ")
    # the manifest is unchanged, so the signature is valid; require_signature turns verification on
    one_line_error(lambda: load(art, verify=False, require_signature=pub), "tokenizer_config.json", "checksum")


def test_unsigned_artifact_is_refused_when_a_signature_is_required(art, keys):
    (_, pub), _ = keys
    one_line_error(lambda: load(art, require_signature=pub), "signature.json", "not signed")


def test_bad_keys_are_one_line(art, keys, tmp_path):
    from dsc.runtime.artifact import sign
    from dsc.runtime.signature import keygen

    (priv, pub), _ = keys
    junk = tmp_path / "junk.pem"
    junk.write_text("not a key")
    one_line_error(lambda: sign(art, junk), "junk.pem", "private key")
    one_line_error(lambda: sign(art, pub), "private key")
    one_line_error(lambda: load(art, require_signature=junk), "junk.pem", "public key")
    one_line_error(lambda: load(art, require_signature=tmp_path / "none.pub"), "none.pub")
    one_line_error(lambda: keygen(priv), "exists")


def test_sign_and_require_signature_through_the_cli(art, tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "dsc", *args], capture_output=True, text=True, timeout=300)

    key = tmp_path / "k"
    assert run("keygen", str(key)).returncode == 0
    assert oct((key).stat().st_mode & 0o777) == "0o600"
    assert run("sign", str(art), "--key", str(key)).returncode == 0
    ok = run("generate", str(art), "--token-ids", "1,2", "--max-new-tokens", "2", "--require-signature", f"{key}.pub")
    assert ok.returncode == 0, ok.stderr
    assert run("inspect", str(art), "--require-signature", f"{key}.pub").returncode == 0
    m = read_json(art / "manifest.json")
    m["command"] = ["edited"]
    write_json(art / "manifest.json", m)
    bad = run("generate", str(art), "--token-ids", "1,2", "--require-signature", f"{key}.pub")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.count("\n") == 1 and "signature" in bad.stderr


# -- compile output: cleanup, atomic replacement, races ---------------------------------------


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_leftovers_of_a_killed_compile_are_removed(make_checkpoint, tmp_path):
    out = tmp_path / "art"
    left = tmp_path / f".art.tmp-{_dead_pid()}"
    left.mkdir()
    (left / "rank0.safetensors").write_bytes(b"x" * 1000)
    other = tmp_path / f".other.tmp-{_dead_pid()}"  # another destination's: not ours to remove
    other.mkdir()
    dsc.compile(str(make_checkpoint("llama-tiny")), out, dtype="fp32", max_seq=16, max_batch=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [other.name, "art"]


def test_temp_folder_is_removed_on_sigterm(tmp_path):
    from dsc.compiler.emit import _removed_on_termination

    tmp = tmp_path / ".art.tmp-1"
    tmp.mkdir()
    with pytest.raises(SystemExit), _removed_on_termination(tmp):
        (tmp / "plan.json").write_text("{}")
        os.kill(os.getpid(), signal.SIGTERM)
        signal.pause()  # the handler raises before this returns
    assert not tmp.exists()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_replacing_an_artifact_never_leaves_the_destination_missing(tmp_path):
    from dsc.compiler import emit

    out = tmp_path / "art"
    out.mkdir()
    (out / "manifest.json").write_text("old")
    tmp = tmp_path / ".art.tmp-1"
    tmp.mkdir()
    (tmp / "manifest.json").write_text("new")
    seen = []
    stop = threading.Event()

    def watch():  # the destination is looked at throughout the swap
        while not stop.is_set():
            seen.append(out.exists())

    t = threading.Thread(target=watch)
    t.start()
    try:
        emit._publish(tmp, out)
    finally:
        stop.set()
        t.join()
    assert (out / "manifest.json").read_text() == "new" and not tmp.exists()
    assert all(seen)


def test_a_replacement_that_died_between_its_renames_is_recovered(make_checkpoint, tmp_path):
    from dsc.compiler.emit import _recover_leftovers

    out = tmp_path / "art"
    old = tmp_path / f".art.old-{_dead_pid()}-beef"
    old.mkdir()
    (old / "manifest.json").write_text("the previous artifact")
    _recover_leftovers(out)
    assert (out / "manifest.json").read_text() == "the previous artifact" and not old.exists()


def test_racing_compiles_one_result_one_clear_line(tmp_path, monkeypatch):
    from dsc.compiler import emit

    out = tmp_path / "art"
    first, second = tmp_path / ".art.tmp-1", tmp_path / ".art.tmp-2"
    for d, text in ((first, "first"), (second, "second")):
        d.mkdir()
        (d / "manifest.json").write_text(text)
    emit._publish(first, out)
    # the second compile looked before the first landed (forced: it sees no destination)
    real_exists = Path.exists
    monkeypatch.setattr(Path, "exists", lambda p: False if p == out else real_exists(p))
    with pytest.raises(UserError, match="another compile"):
        with emit._removed_on_termination(second):
            emit._publish(second, out)
    monkeypatch.undo()
    assert (out / "manifest.json").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_inspect_shows_artifact_text_as_text(art):
    plan = read_json(art / "plan.json")
    plan["model"]["model_type"] = "[/x] [bold"  # rich markup would raise on this
    plan["notes"]["k"] = "[/y]"
    write_json(art / "plan.json", plan)
    m = read_json(art / "manifest.json")
    m["int8_report"] = {"mode": 1}
    write_json(art / "manifest.json", m)
    rehash(art)
    r = subprocess.run([sys.executable, "-m", "dsc", "inspect", str(art)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "[/x] [bold" in r.stdout and "note k: [/y]" in r.stdout and "int8 report: malformed" in r.stdout
